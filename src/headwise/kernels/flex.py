"""torch's FlexAttention behind headwise's contract: ``backend="flex"``.

``torch.nn.attention.flex_attention`` runs any mask_mod / score_mod in one fused kernel where
``torch.compile`` lowers it: Triton on a CUDA GPU (forward, backward, log-sum-exp), and a C++
template on an x86 CPU with AVX2, which in torch 2.13 serves inference only and returns no
log-sum-exp. Not compiled, it is an unfused reference that materialises the (B, H, S, Sk)
scores; this kernel never runs that, and refuses (with the reason) where it would.

How the contract maps onto Flex:

* The caller's mask, the causal / window / sink-token rule and ``mask_mod`` become one
  mask_mod, and one ``BlockMask`` of 128 x 128 blocks built from headwise's tile states
  (:meth:`headwise.rules.Rules.tile_states` for the rules, a reduction for the mask tensor),
  not from ``create_block_mask``: empty blocks are never visited, full blocks run without the
  mask_mod. The rules' states are kept per (rule, shape) while the rule object lives.
* Soft-capping, ALiBi, ``score_mod`` and a float mask become one score_mod, in the
  contract's order (softcap, ALiBi, score_mod, then the mask's bias).
* Attention sinks: one appended key whose score is the head's sink logit and whose value is
  zero (the sdpa kernel's trick, carried by the score_mod instead of a float mask).
* On an AVX2 CPU, q and k with a head dim of 8 or 16 run with zero columns up to 32
  (:data:`CPU_WRONG_HEAD_DIMS`): torch 2.13's C++ template computes those head dims wrong at
  8, 24, 40, ... keys.
* What no query may attend (NaN and inf there included) has been zeroed by
  :func:`headwise.mask_contract.hide_excluded` before any kernel runs, as
  :func:`headwise.attention` does for every kernel. Flex multiplies ``p = 0`` by v inside a
  partial block, so a caller of this function itself must do the same.
* A row that may attend nothing: Flex gives zeros and ``lse = -inf`` (no key is visited, or
  every score is masked).
* Compiled once per shape family: ``torch.compile`` of one small function around
  ``flex_attention`` (:func:`_flex`), with the sizes of q, k, v and the block lists dynamic;
  the closures built per call (same code, new tensors) and new sizes reuse its graphs. Each
  different rule (a new mask_mod or score_mod function, another set of the built-in rules, a
  new scale), dtype, head count, and on the CPU each size of a tensor a rule reads (the mask,
  a document's ids), compiles once: seconds on a CPU. Inside a graph the caller compiles,
  flex_attention is called in that graph.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim of q and k, Dv head dim of v, nq / nk the 128-row / 128-column blocks along S / Sk.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import platform
import shutil
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from headwise.kernels import describe
from headwise.kernels.common import attached_zeros, lse_dtype
from headwise.kernels.registry import Call, Kernel, KernelResult, KernelStage, Request
from headwise.rules import Rules
from headwise.tiles import EMPTY, FULL, PARTIAL

__all__ = ["KERNEL", "flex_attention_kernel"]

# A BlockMask's lists: (kv_num_blocks, kv_indices, full_kv_num_blocks, full_kv_indices) and, for
# backward, the same per column (q_num_blocks, q_indices, full_q_num_blocks, full_q_indices) or Nones.
Lists = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]

BLOCK = (128, 128)  # (rows, columns) of one BlockMask block: Flex's default sparse block
DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what flex_attention's lowerings take
GPU_MIN_HEAD_DIM = 16  # Flex's Triton kernel: tl.dot needs head dims of at least 16 (narrower ones are padded)
# torch 2.13's C++ template on an AVX2 CPU computes wrong outputs (wrong numbers, at times NaN) where
# q and k have a head dim of 8 or 16 and the key count is 8 more than a multiple of 16: 8, 24,
# 40, ... keys, an appended sink key included. Measured on an AMD EPYC without AVX-512 against
# softmax(q k^T) v, fp32 and bf16: head dims 1-33, 40, 48, 56, 64, 80, 96, 128 and 256 at 8 and
# 24 keys, and 8, 16, 32, 64 at 1-40, 48, 64, 72, 128 and 136 keys; only those two head dims
# failed. Such q and k run with zero columns up to CPU_SAFE_HEAD_DIM, which change no score.
CPU_WRONG_HEAD_DIMS = (8, 16)
CPU_SAFE_HEAD_DIM = 32
RECOMPILE_LIMIT = 64  # graphs of the one compiled function: rules x shape families x dtypes
_TORCH = torch.__version__.split("+")[0]


# ---------------------------------------------------------------- where it runs, what it refuses


def _available() -> str | None:
    if not _HAS_FLEX:
        return f"torch {_TORCH} has no torch.nn.attention.flex_attention (FlexAttention came with torch 2.5)"
    if os.environ.get("TORCHDYNAMO_DISABLE", "0") not in ("", "0"):
        return ("torch.compile is disabled (TORCHDYNAMO_DISABLE is set), and flex_attention uncompiled is an "
                "unfused reference that materialises the (B, H, S, Sk) scores")
    return None


def _cpu_compiles() -> str | None:
    """None where torch.compile lowers flex_attention on this CPU, else why not (read at import:
    :data:`_CPU_COMPILES`)."""
    avx2 = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    if not avx2 or sys.platform == "darwin" or platform.machine().lower() not in ("x86_64", "amd64"):
        return (f"torch.compile lowers flex_attention on the CPU only for x86 CPUs with AVX2, not macOS (this one: "
                f"{platform.machine()} {sys.platform}, CPU capability {torch.backends.cpu.get_cpu_capability()}), "
                "and uncompiled it is an unfused reference")
    compilers = [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
    if not any(c and shutil.which(c) for c in compilers):
        return ("torch.compile needs a C++ compiler on the CPU (g++ or clang++, or $CXX) and none is on the PATH; "
                "uncompiled, flex_attention is an unfused reference")
    return None


# Read once, at import, as constants: dispatch asks on every new request, also inside a graph the
# caller compiles, where torch.compile would trace a look-up (or a cache around one) and guard on it.
_HAS_FLEX = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
_CPU_COMPILES = _cpu_compiles()
_CPU_AVX2_ONLY = torch.backends.cpu.get_cpu_capability() == "AVX2"  # see CPU_WRONG_HEAD_DIMS


def _triton_installed() -> bool:
    return _TRITON_INSTALLED


def _refuses(r: Request) -> str | None:
    if r.dtype not in DTYPES:
        return f"takes float16, bfloat16 and float32 (flex_attention's lowerings), got {r.dtype}"
    if r.dropout_p > 0:
        return f"has no dropout (dropout_p={r.dropout_p}): flex_attention applies none"
    if r.device.type == "cuda":
        return _refuses_gpu()
    if r.device.type == "cpu":
        return _refuses_cpu(r.requires_grad or r.score_mod_grad, r.return_lse)
    return f"runs on CUDA GPUs and x86 CPUs through torch.compile, got device {str(r.device)!r}"


def _refuses_gpu() -> str | None:
    if not _triton_installed():
        return "needs triton on a GPU (torch.compile writes Flex's kernel in Triton), which is not installed"
    return None


def _refuses_cpu(gradients: bool, lse: bool) -> str | None:
    if gradients:
        return (f"serves only inference on the CPU: torch {_TORCH}'s compiled CPU flex_attention has no backward, and "
                "uncompiled it is an unfused reference; call it under torch.no_grad() or torch.inference_mode(), "
                "or train on a GPU")
    if lse:
        return (f"returns no log-sum-exp on the CPU (return_lse, or the weights computed from it): torch {_TORCH}'s "
                "compiled CPU flex_attention does not output it")
    return _CPU_COMPILES


def _refuses_call(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, rules: Rules, dropout_p: float,
                  return_lse: bool) -> str | None:
    """:func:`_refuses` on the tensors themselves, for a call that did not come through dispatch
    (every tensor's ``requires_grad`` counts here, v's, the mask's and the rules' included)."""
    if q.dtype not in DTYPES or dropout_p > 0:
        return _refuses(_request_of(q, k, dropout_p))
    if q.device.type == "cuda":
        return _refuses_gpu()
    if q.device.type != "cpu":
        return _refuses(_request_of(q, k, dropout_p))
    grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (q, k, v, mask, rules.alibi_slopes, rules.sinks))
    return _refuses_cpu(grad, return_lse)


def _request_of(q: Tensor, k: Tensor, dropout_p: float) -> Request:
    B, H, S, D = q.shape
    return Request(device=q.device, dtype=q.dtype, batch=B, heads=H, kv_heads=k.shape[1], q_len=S,
                   k_len=k.shape[2], head_dim=D, mask_kind="none", mask_shape=None, is_causal=False,
                   dropout_p=dropout_p, need_weights=False, requires_grad=False)


# ---------------------------------------------------------------- the rules as Flex's two functions


def _scalar(value: float, dtype: torch.dtype, device: torch.device) -> Any:
    """A number the rules read, as a 0-d tensor: one per (value, dtype, device), kept.

    torch.compile guards on a Python number a closure holds and compiles once per value (each
    offset Sk - S, each window); a tensor is an input instead, and one kept per value spares a GPU
    call the copy of a new one to the device. Inside a graph the caller compiles, the number
    itself: Flex's CPU template cannot read a tensor made inside the graph (NoValidChoicesError)."""
    if torch.compiler.is_compiling():
        return value
    return _scalar_tensor(value, dtype, device)


@functools.lru_cache(maxsize=256)
def _scalar_tensor(value: float, dtype: torch.dtype, device: torch.device) -> Tensor:
    return torch.tensor(value, dtype=dtype, device=device)


def _mask_mod(mask: Tensor | None, rules: Rules, S: int, Sk: int, sink: bool,
              device: torch.device) -> Callable | None:
    """The caller's mask, the causal / window rule and mask_mod as one mask_mod, with the sink
    key (index Sk, where ``sink``) always allowed; None where nothing is masked. ``mask`` is the
    normalised (B|1, H|1, S|1, Sk) mask."""
    parts: list[Callable] = []
    if mask is not None:  # read as it is: a table made here would be one made inside a caller's graph
        parts.append(_lookup(mask) if mask.dtype == torch.bool else _not_excluded(_lookup(mask)))
    if rules.is_causal or rules.window is not None:
        parts.append(_causal(rules, S, Sk, device))
    if rules.mask_mod is not None:
        parts.append(rules.mask_mod)
    if not parts:
        return None  # the sink key too is visible to every query
    last = _scalar(Sk - 1, torch.int64, device)

    def mask_mod(b, h, q_idx, kv_idx):
        key = kv_idx.clamp(max=last) if sink else kv_idx  # the sink's index Sk is past every rule's keys
        allowed = parts[0](b, h, q_idx, key)
        for part in parts[1:]:
            allowed = allowed & part(b, h, q_idx, key)
        return allowed | (kv_idx > last) if sink else allowed

    return mask_mod


def _lookup(table: Tensor) -> Callable:
    """``table[b, h, q_idx, kv_idx]`` of a (B|1, H|1, S|1, Sk) tensor, its dims of size 1 broadcast."""
    def at(b, h, q_idx, kv_idx):
        return table[b if table.shape[0] > 1 else 0, h if table.shape[1] > 1 else 0,
                     q_idx if table.shape[2] > 1 else 0, kv_idx]

    return at


def _not_excluded(bias: Callable) -> Callable:
    """The pairs a float mask does not exclude (its -inf), as a mask_mod."""
    def allowed(b, h, q_idx, kv_idx):
        return ~torch.isneginf(bias(b, h, q_idx, kv_idx))

    return allowed


def _causal(rules: Rules, S: int, Sk: int, device: torch.device) -> Callable:
    """The bottom-right causal rule, ``kv_idx <= q_idx + Sk - S``, with its window and sink tokens."""
    offset = _scalar(Sk - S, torch.int64, device)
    width = None if rules.window is None else _scalar(rules.window, torch.int64, device)
    sinks = _scalar(rules.sink_tokens, torch.int64, device)

    def causal(b, h, q_idx, kv_idx):
        i = q_idx + offset
        allowed = kv_idx <= i
        if width is not None:
            allowed = allowed & ((kv_idx > i - width) | (kv_idx < sinks))
        return allowed

    return causal


def _score_mod(mask: Tensor | None, rules: Rules, S: int, Sk: int, device: torch.device) -> Callable | None:
    """softcap, ALiBi, score_mod, a float mask's bias and the sink logits as one score_mod, in
    the contract's order; None where the scores are used as they are."""
    cap = None if rules.softcap is None else _scalar(rules.softcap, torch.float32, device)
    slopes = rules.alibi_slopes  # (H,) or None
    bias = None if mask is None or mask.dtype == torch.bool else _lookup(mask)
    user, sinks = rules.score_mod, rules.sinks
    if cap is None and slopes is None and user is None and bias is None and sinks is None:
        return None
    offset, last = _scalar(Sk - S, torch.int64, device), _scalar(Sk - 1, torch.int64, device)

    def score_mod(score, b, h, q_idx, kv_idx):
        dtype = score.dtype  # the rules' numbers are float32: the result keeps the score's dtype
        key = kv_idx.clamp(max=last) if sinks is not None else kv_idx
        if cap is not None:
            score = torch.tanh(score / cap) * cap
        if slopes is not None:
            score = score - slopes[h] * (q_idx + offset - key).abs()
        if user is not None:
            score = user(score, b, h, q_idx, key)
        if bias is not None:
            score = score + bias(b, h, q_idx, key)
        if sinks is not None:
            score = torch.where(kv_idx > last, sinks[h], score)
        return score.to(dtype)

    return score_mod


# ---------------------------------------------------------------- the BlockMask, from tile states


def _mask_states(mask: Tensor, S: int, Sk: int) -> Tensor:
    """Block states of a normalised mask (B|1, H|1, S|1, Sk): int8 (B|1, H|1, nq, nk), a block
    full where every pair may attend (no -inf in a float mask), empty where none may."""
    keep = mask if mask.dtype == torch.bool else ~torch.isneginf(mask)
    b, h, s, _ = keep.shape
    bq, bk = BLOCK
    rows = bq if s > 1 else 1
    pad = (0, (-Sk) % bk, 0, (-s) % rows)  # repeats the last row and column: "any" and "all" stay
    padded = F.pad(keep.to(torch.uint8), pad, mode="replicate") if any(pad) else keep.to(torch.uint8)
    blocks = padded.reshape(b, h, padded.shape[2] // rows, rows, padded.shape[3] // bk, bk)
    some, every = blocks.amax(dim=(3, 5)).bool(), blocks.amin(dim=(3, 5)).bool()  # (b, h, nq|1, nk)
    states = torch.where(every, FULL, torch.where(some, PARTIAL, EMPTY)).to(torch.int8)
    return states.expand(b, h, -(-S // bq), states.shape[3])  # (B|1, H|1, nq, nk)


# (B, H, S, Sk, device, is_causal, window, sink_tokens) -> states, per mask_mod object while it lives
_RULE_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_NO_RULE = type("_NoRule", (), {})()  # the key of the keyword rules alone (no mask_mod)


def _kept(rules: Rules, key: tuple, make: Callable[[], Any]) -> Any:
    """``make()``, kept per (the rules' mask_mod object, ``key``) while that object lives.

    The memo holds an entry only while its mask_mod object lives (a weak key), so a rule built
    per call is evaluated per call, and a rule kept across calls (a module's, a TileMap) once
    per shape. A rule whose tensors change in place must be a new object, as for a TileMap."""
    if torch.compiler.is_compiling():
        return make()
    owner = _NO_RULE if rules.mask_mod is None else rules.mask_mod
    try:
        memo = _RULE_STATES.setdefault(owner, {})
    except TypeError:  # not weakly referable or not hashable: no memo
        return make()
    key = (*key, rules.is_causal, rules.window, rules.sink_tokens)
    if key not in memo:
        if len(memo) >= 64:  # one rule over many shapes: keep the latest
            memo.clear()
        memo[key] = make()
    return memo[key]


def _rule_states(rules: Rules, B: int, H: int, S: int, Sk: int, device: torch.device) -> Tensor | None:
    """The rules' block states, int8 (B|1, H|1, nq, nk) (None: no mask rule), kept per (rule, shape)."""
    if not (rules.is_causal or rules.window is not None or rules.mask_mod is not None):
        return None
    return _kept(rules, ("states", B, H, S, Sk, str(device)),
                 lambda: rules.tile_states(B, H, S, Sk, BLOCK, device))


def _ordered(dense: Tensor) -> tuple[Tensor, Tensor]:
    """Flex's (num_blocks, indices) of a bool (B|1, H|1, rows, cols) block grid: per row, how many
    blocks are set and their columns first (in order), int32 (B|1, H|1, rows), (B|1, H|1, rows, cols)."""
    as_int = dense.to(torch.int32)
    order = torch.argsort(as_int, dim=-1, descending=True, stable=True)
    return as_int.sum(-1).to(torch.int32), order.to(torch.int32)


def _block_lists(states: Tensor, backward: bool) -> Lists:
    """A Flex ``BlockMask``'s lists from int8 block states (B|1, H|1, nq, nk): per row of blocks the
    partial ones (which run the mask_mod), then the full ones (which run unmasked); empty blocks
    are never listed. ``backward``: also the lists per column, which Flex's backward walks."""
    partial, full = states == PARTIAL, states == FULL  # (B|1, H|1, nq, nk)
    (kv_num, kv_index), (full_num, full_index) = _ordered(partial), _ordered(full)
    if not backward:
        return kv_num, kv_index, full_num, full_index, None, None, None, None
    (q_num, q_index), (full_q_num, full_q_index) = _ordered(partial.transpose(-2, -1)), _ordered(full.transpose(-2, -1))
    return kv_num, kv_index, full_num, full_index, q_num, q_index, full_q_num, full_q_index


def _with_sink_column(states: Tensor, Sk: int) -> Tensor:
    """Block states for Sk + 1 keys, the last one the sink key every query attends."""
    if Sk % BLOCK[1] == 0:  # the sink opens a block of its own: full
        column = torch.full_like(states[..., :1], FULL)
        return torch.cat([states, column], dim=-1)  # (B|1, H|1, nq, nk + 1)
    last = torch.where(states[..., -1:] == FULL, FULL, PARTIAL).to(torch.int8)  # the sink makes no block empty
    return torch.cat([states[..., :-1], last], dim=-1)


def _blocks(mask: Tensor | None, rules: Rules, B: int, H: int, S: int, Sk: int, device: torch.device,
            sink: bool, backward: bool) -> Lists | None:
    """The call's BlockMask lists (:func:`_block_lists`; None: no block is masked, Flex's default),
    kept per (rule, shape) where no mask tensor joins the rules."""
    if mask is None:
        return _kept(rules, ("lists", B, H, S, Sk, str(device), sink, backward),
                     lambda: _lists(None, rules, B, H, S, Sk, device, sink, backward))
    return _lists(mask, rules, B, H, S, Sk, device, sink, backward)


def _lists(mask: Tensor | None, rules: Rules, B: int, H: int, S: int, Sk: int, device: torch.device,
           sink: bool, backward: bool) -> Lists | None:
    states = _rule_states(rules, B, H, S, Sk, device)
    if mask is not None:
        own = _mask_states(mask, S, Sk)
        states = own if states is None else torch.minimum(states, own)  # AND of two states: the lesser
    if states is None:
        return None
    if sink:
        states = _with_sink_column(states, Sk)
    return _block_lists(states.to(device), backward)


# ---------------------------------------------------------------- the compiled call


def _flex(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable | None, mask_mod: Callable | None,
          lists: Lists | None, scale: float, gqa: bool, lse: bool) -> tuple[Tensor, Tensor | None]:
    """``flex_attention`` itself: out (B, H, S, Dv) and, with ``lse``, its (B, H, S) log-sum-exp.

    The BlockMask is made here, inside the compiled function, from its lists (:func:`_block_lists`)
    and the sizes of q and k: made outside, its (Q_LEN, KV_LEN) would be numbers torch.compile
    guards on, one graph per length."""
    from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention, noop_mask

    block_mask = None
    if lists is not None:
        block_mask = BlockMask((q.shape[-2], k.shape[-2]), lists[0], lists[1], lists[2], lists[3], lists[4], lists[5],
                               lists[6], lists[7], BLOCK_SIZE=BLOCK, mask_mod=mask_mod or noop_mask)
    if not lse:
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa), None
    out, aux = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=scale, enable_gqa=gqa,
                              return_aux=AuxRequest(lse=True))
    return out, aux.lse


@functools.cache
def _compiled(dynamic: bool | None) -> Callable:
    """:func:`_flex` under torch.compile, made once per ``dynamic`` (see :func:`_run`)."""
    return torch.compile(_flex, dynamic=dynamic)


def _run(q: Tensor, k: Tensor, v: Tensor, score_mod: Callable | None, mask_mod: Callable | None,
         lists: Lists | None, scale: float, lse: bool) -> tuple[Tensor, Tensor | None]:
    """:func:`_flex` compiled (inlined where the caller is compiling already), once per shape family.

    On a GPU every size is dynamic from the first call. On the CPU only the sizes of q, k, v
    and the block lists are: torch 2.13's C++ template names the tile sizes in a rule's code by
    string replacement, which also rewrites a longer size name that starts with the same
    characters (``ks5`` inside ``ks55``) and then fails to compile, so a tensor a rule reads (the
    mask, a document's ids) keeps static sizes: one graph per size of that tensor."""
    gqa = k.shape[1] != q.shape[1]
    if torch.compiler.is_compiling():
        return _flex(q, k, v, score_mod, mask_mod, lists, scale, gqa, lse)
    dynamo: Any = importlib.import_module("torch._dynamo")  # loaded here, not with headwise: it takes seconds
    if not dynamo.is_dynamo_supported():
        raise ValueError(f"the flex kernel needs torch.compile, which torch {_TORCH} does not support on Python "
                         f"{sys.version.split()[0]}; uncompiled, flex_attention is an unfused reference")
    # every rule and shape family is one graph of the same function: more than dynamo's default of 8
    limit = max(dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    if q.device.type == "cuda":
        with dynamo.config.patch(recompile_limit=limit):
            return _compiled(True)(q, k, v, score_mod, mask_mod, lists, scale, gqa, lse)
    q, k, v = (t.view(t.shape) for t in (q, k, v))  # views: the caller's tensors stay unmarked
    for t in (q, k, v):
        _dynamic(dynamo, t, (0, 2))
    for n, part in enumerate(lists or ()):  # (num_blocks, indices) pairs: (B|1, H|1, rows), (B|1, H|1, rows, cols)
        _dynamic(dynamo, part, (2,) if n % 2 == 0 else (2, 3))
    with dynamo.config.patch(recompile_limit=limit, automatic_dynamic_shapes=False):
        return _compiled(None)(q, k, v, score_mod, mask_mod, lists, scale, gqa, lse)


def _dynamic(dynamo: Any, t: Tensor | None, dims: tuple[int, ...]) -> None:
    """Mark ``dims`` of ``t`` dynamic for torch.compile (a size that compiles as 1 stays 1)."""
    if t is not None:
        dynamo.maybe_mark_dynamic(t, list(dims))


def _widened(q: Tensor, k: Tensor, v: Tensor, qk_width: int, v_width: int) -> tuple[Tensor, Tensor, Tensor]:
    """q and k with their head dims padded with zeros to at least ``qk_width``, v's to at least
    ``v_width``: zero columns change no score, and v's add output columns the caller drops."""
    D, Dv = q.shape[-1], v.shape[-1]
    width = max(D, qk_width)
    q, k = F.pad(q, (0, width - D)), F.pad(k, (0, width - D))  # (B, H|Hkv, S|Sk, width)
    return q, k, F.pad(v, (0, max(Dv, v_width) - Dv))  # (B, Hkv, Sk, max(Dv, v_width))


def _cpu_widens(q: Tensor) -> bool:
    """Whether q and k run widened to :data:`CPU_SAFE_HEAD_DIM` (see :data:`CPU_WRONG_HEAD_DIMS`)."""
    return q.device.type == "cpu" and _CPU_AVX2_ONLY and q.shape[-1] in CPU_WRONG_HEAD_DIMS


def _append_sink_key(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """k (B, Hkv, Sk, D) and v (B, Hkv, Sk, Dv) with one more key and value, zeros: the sink's."""
    return F.pad(k, (0, 0, 0, 1)), F.pad(v, (0, 0, 0, 1))  # (B, Hkv, Sk + 1, D), (B, Hkv, Sk + 1, Dv)


def flex_attention_kernel(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attention_mask: Tensor | None,
    rules: Rules,
    dropout_p: float,
    scale: float,
    need_weights: bool,
    return_lse: bool = False,  # True: the result's lse (B, H, S) too; on a GPU only
) -> KernelResult:
    """Attention through torch's compiled ``flex_attention``; see :mod:`headwise.kernels.flex`.

    Args:
        q: (B, H, S, D) float16, bfloat16 or float32.
        k, v: (B, Hkv, Sk, D) and (B, Hkv, Sk, Dv), H % Hkv == 0.
        attention_mask: None or the normalised mask (B|1, H|1, S|1, Sk), bool or additive float.
        rules: every rule of the contract: causal, window, sink tokens, ALiBi, softcap, sinks,
            mask_mod and score_mod.
        dropout_p: must be 0.
        scale: multiplier of q k^T.
        need_weights: must be False (the registry never asks this kernel for weights).
        return_lse: also return each row's log-sum-exp (natural log, ``-inf`` for a row that
            attends nothing, sinks counted); on a GPU only.

    Returns:
        ``KernelResult(out, None, lse)``: out (B, H, S, Dv) in q's dtype; lse (B, H, S) float32
        with ``return_lse``, else None.

    Raises:
        ValueError: what :data:`KERNEL` refuses (the reason names the way out): a dtype other
            than float16, bfloat16 or float32, dropout, gradients or the log-sum-exp on the CPU,
            a CPU or GPU torch.compile cannot lower Flex for.
    """
    why = _refuses_call(q, k, v, attention_mask, rules, dropout_p, return_lse)
    if why is not None:
        raise ValueError(f"the flex kernel {why}; use backend 'chunked' or 'sdpa'")
    if not torch.is_grad_enabled():  # Flex refuses a CPU input that requires grad, even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    B, H, S, _ = q.shape
    Sk = k.shape[2]
    if B * S * Sk == 0:  # no row, or nothing to attend: Flex's CPU kernel divides by these sizes
        return _empty(q, k, v, rules.sinks, return_lse)
    sink = rules.sinks is not None
    if sink:
        k, v = _append_sink_key(k, v)
    Dv = v.shape[-1]
    if q.device.type == "cuda" and min(q.shape[-1], Dv) < GPU_MIN_HEAD_DIM:
        q, k, v = _widened(q, k, v, GPU_MIN_HEAD_DIM, GPU_MIN_HEAD_DIM)  # v's extra output columns are dropped
    elif _cpu_widens(q):
        q, k, v = _widened(q, k, v, CPU_SAFE_HEAD_DIM, Dv)
    backward = torch.is_grad_enabled() and q.device.type == "cuda"  # any input may learn: sinks, a bias table
    lists = _blocks(attention_mask, rules, B, H, S, Sk, q.device, sink, backward)
    mask_mod = _mask_mod(attention_mask, rules, S, Sk, sink, q.device)
    score_mod = _score_mod(attention_mask, rules, S, Sk, q.device)
    out, lse = _run(q, k, v, score_mod, mask_mod, lists, scale, return_lse)
    out = out[..., :Dv]  # (B, H, S, Dv)
    return KernelResult(out, None, None if lse is None else lse.to(lse_dtype(q.dtype)))


def _empty(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, return_lse: bool) -> KernelResult:
    """B, S or Sk = 0: zeros (B, H, S, Dv) in the inputs' graph, and an lse of -inf (the sink's
    logit where sinks join the softmax: the one column left)."""
    B, H, S, _ = q.shape
    out = attached_zeros(q, k, v, size=v.shape[-1])  # (B, H, S, Dv)
    if not return_lse:
        return KernelResult(out)
    lse = torch.full((B, H, S), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    if sinks is not None:
        lse = sinks.to(lse.dtype).reshape(1, H, 1).expand(B, H, S) + attached_zeros(lse, q, k, v)
    return KernelResult(out, None, lse)


def flex_stages(call: Call) -> list[KernelStage]:
    """Explain mode's stage of :func:`flex_attention_kernel` for one call: one fused stage."""
    where = "Triton" if call.q.device.type == "cuda" else "C++"
    how = (f"in torch.compile(flex_attention) ({where}), with a BlockMask of {BLOCK[0]} x {BLOCK[1]} blocks from "
           "headwise's tile states: empty blocks skipped, full blocks without the mask_mod")
    if call.rules.describe():
        how += f"; {call.rules.describe()}"
    if call.sinks is not None:
        how += "; the sink logits as the score of one appended zero key and value"
    if _cpu_widens(call.q):
        how += (f"; q and k widened from {call.q.shape[-1]} to {CPU_SAFE_HEAD_DIM} zero columns (torch {_TORCH}'s AVX2 "
                "template computes head dims 8 and 16 wrong at 8, 24, 40, ... keys)")
    how += describe.shared_kv(call)
    return [describe.fused(call, "flex", how, f"scores {describe.scores_shape(call)} not materialised")]


KERNEL = Kernel(
    name="flex",
    fn=flex_attention_kernel,
    summary=("torch's flex_attention, compiled: any mask_mod / score_mod fused, empty blocks skipped (GPU: training "
             "and inference; x86 CPU: inference)"),
    native_gqa=True,
    fused=True,
    available=_available,
    refuses=_refuses,
    stages=flex_stages,
    forward_ad=False,  # flex_attention's operator has no forward derivative
    functorch=False,  # a compiled function: no torch.func transforms through it
    compiles=True,  # seconds per new rule or shape family, on the CPU and the GPU
)

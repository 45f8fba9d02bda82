"""The q, k and v weights in adjacent memory: one GEMM, and no copy, where no gradient is
taken.

``q_proj``, ``k_proj`` and ``v_proj`` stay three ordinary ``nn.Linear``, each weight a
tensor of its own storage (safetensors, PEFT, optimizers and ``state_dict`` see three
weights, exactly as before), but the three weights lie one after another in the memory of
one (Nq + Nk + Nv, E) tensor, and the biases in one (Nq + Nk + Nv,) tensor: the layout of
``nn.MultiheadAttention``'s ``in_proj_weight``. (Each weight's storage is a DLPack alias of
its rows: a storage that covers exactly the weight, over memory the whole tensor owns. Plain
views of one storage would not do: safetensors' ``save_model`` refuses tensors that share a
storage none of them covers. Such a storage cannot be resized in place.) A call without
gradients then projects x with one GEMM over the whole tensor (the dense, packed and cached
paths), and the fused path hands it to its op as it is (it used to concatenate the three
weights on every call).

Nothing is remembered that could go stale: the rows are the weights' own memory. A write
in place, through ``.data`` too (``w.data.copy_(t)``, as PEFT's ``merge_and_unload`` may
write), lands in the rows. Anything that gives a weight other memory (``w.data = t``, a
replaced, wrapped or quantised projection, ``load_state_dict(assign=True)``,
``share_memory()``) takes it out of the rows, and :func:`packed`, which runs on every call,
sees that from the pointers: the projections then run as three calls, as before packing.

:func:`pack` puts the weights in rows at construction, after an ``_apply`` that gave each
of them new memory (``to()`` of another dtype or device, ``double()``, ``to_empty()``), after
``copy.deepcopy`` and after unpickling (both give each weight its own memory). It never
moves a weight the user gave other memory: that memory may be shared, memory-mapped or
tied elsewhere. CPU only: the fused path and the GEMMs whose count matters are there.

Legend: E embed dim, Nq = H*D, Nk = Hkv*D and Nv = Hkv*Dv, the rows of q, k and v.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import forward_ad

from headwise.module.layer_protocol import Layer

_NAMES = ("q_proj", "k_proj", "v_proj")
_PLAIN = (nn.Parameter, Tensor)


@dataclass(frozen=True, eq=False)
class Pack:
    """The rows the q, k and v weights and biases lie in.

    Attributes:
        weight: (Nq + Nk + Nv, E), q, k, v rows stacked.
        bias: (Nq + Nk + Nv,), or None without biases.
        rows: (Nq, Nk, Nv).
        params: the parameters put in the rows: the three weights, then the three biases if any.
        shapes: the weights' shapes, (Nq, E), (Nk, E), (Nv, E).
    """

    weight: Tensor
    bias: Tensor | None
    rows: tuple[int, int, int]
    params: tuple[nn.Parameter, ...]
    shapes: tuple[torch.Size, ...]

    def __post_init__(self) -> None:
        # Where each parameter lies in the rows (read by holds() on every call): the weights'
        # pointers, then the biases' (or Nones), and the biases' lengths.
        size, E = self.weight.element_size(), self.weight.shape[1]
        w_ptr, b_ptr = self.weight.data_ptr(), None if self.bias is None else self.bias.data_ptr()
        starts = (0, self.rows[0], self.rows[0] + self.rows[1])
        pointers = tuple(w_ptr + start * E * size for start in starts) + tuple(
            None if b_ptr is None else b_ptr + start * size for start in starts)
        object.__setattr__(self, "_pointers", pointers)

    def holds(self, params: tuple[Any, ...], grad: bool = False) -> bool:
        """Whether ``params`` (three weights, then three biases or Nones) lie in the rows, in
        order, as plain tensors of the rows' shapes (the weights contiguous); with ``grad``,
        also that none requires grad (the parameters are autograd's leaves, not the rows).

        Reads pointers, shapes and layout only, cheap enough for every call (about 4 us on
        an Intel Xeon, less than the GEMM calls it saves; written out, not as a loop, which
        took 5.4 us): a weight given other memory has another pointer. (A weight viewed in
        place as another dtype of the same size, ``w.data = w.data.view(torch.int32)``, is
        not looked for.)
        """
        wq, wk, wv, bq, bk, bv = params
        pq, pk, pv, pbq, pbk, pbv = self._pointers  # type: ignore[attr-defined]
        sq, sk, sv = self.shapes
        if not (type(wq) in _PLAIN and type(wk) in _PLAIN and type(wv) in _PLAIN
                and wq.data_ptr() == pq and wk.data_ptr() == pk and wv.data_ptr() == pv
                and wq.shape == sq and wk.shape == sk and wv.shape == sv
                and wq.is_contiguous() and wk.is_contiguous() and wv.is_contiguous()):
            return False
        if pbq is None:
            if bq is not None or bk is not None or bv is not None:
                return False
        elif not (type(bq) in _PLAIN and type(bk) in _PLAIN and type(bv) in _PLAIN
                  and bq.data_ptr() == pbq and bk.data_ptr() == pbk and bv.data_ptr() == pbv
                  and bq.shape[0] == sq[0] and bk.shape[0] == sk[0] and bv.shape[0] == sv[0]):
            return False
        return not grad or not (wq.requires_grad or wk.requires_grad or wv.requires_grad
                                or (pbq is not None and (bq.requires_grad or bk.requires_grad or bv.requires_grad)))

    def __deepcopy__(self, memo: dict) -> Pack | None:
        """``copy.deepcopy`` clones each parameter on its own: the copy's go in rows again
        where the original's lie in rows (else the copy holds no pack)."""
        if not self.holds(_with_biases(self.params)):
            return None
        return _put_in_rows(copy.deepcopy(self.params, memo), self.rows)

    def __reduce__(self):
        """Pickled as its parameters: unpickled, they go in rows again (as after deepcopy)."""
        if not self.holds(_with_biases(self.params)):
            return (_nothing, ())
        return (_put_in_rows, (self.params, self.rows))


def transformed() -> bool:
    """Whether a tensor may not be what its pointer says, so that no speed trick may read
    the weights' memory in place of the weights: inside a ``torch.func`` transform (``grad``,
    ``jvp``, ``vmap``: their wrapped tensors have no storage), a forward-AD dual level (a
    dual weight has its primal's pointer and a tangent the rows do not carry), a
    ``__torch_dispatch__`` mode (``FakeTensorMode``, ``make_fx``), torch.compile or a JIT
    trace. Global flags only, about a microsecond together."""
    return (torch.compiler.is_compiling() or functorch_or_dual() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._get_tracing_state() is not None)


def functorch_or_dual() -> bool:
    """Whether a ``torch.func`` transform (``grad``, ``jvp``, ``vmap``, ...) or a forward-AD
    dual level is active (False under torch.compile, which traces the transforms itself)."""
    # the two flags first: torch.compiler.is_compiling() is two Python calls, on every call of the module
    return ((forward_ad._current_level >= 0 or torch._C._functorch.maybe_current_level() is not None)
            and not torch.compiler.is_compiling())


def packed(mha: Layer, grad: bool) -> Pack | None:
    """The :class:`Pack` whose rows the module's q, k and v weights (and biases) lie in at
    this moment, or None: not packed, :func:`transformed`, or ``grad`` (gradients would be
    taken) while one of them requires grad. The caller has checked that nothing hooks or
    wraps the projections."""
    pack = mha.__dict__.get("_qkv")
    if pack is None or transformed():
        return None
    modules = mha._modules
    q: Any = modules["q_proj"]
    k: Any = modules["k_proj"]
    v: Any = modules["v_proj"]
    if type(q) is not nn.Linear or type(k) is not nn.Linear or type(v) is not nn.Linear:
        return None
    pq, pk, pv = q._parameters, k._parameters, v._parameters
    params = (pq.get("weight"), pk.get("weight"), pv.get("weight"), pq.get("bias"), pk.get("bias"), pv.get("bias"))
    return pack if pack.holds(params, grad) else None


def stacked(mha: Layer, grad: bool) -> tuple[Tensor, Tensor | None, tuple[int, int, int]] | None:
    """The q, k and v weights (and biases) as one (Nq + Nk + Nv, E) matrix, with their row
    counts: the :class:`Pack`'s rows where they serve (:func:`packed`), else the three
    concatenated, in autograd's graph of each parameter (a copy, about 3 E^2 values). None
    where :func:`_parts` finds no three weights that could lie in rows (on any device). The
    batch-invariant mode projects self-attention through it always, with or without gradients
    and wherever the weights lie: one tiled GEMM (N = Nq + Nk + Nv) in every case, so that no
    GEMM library's choice by N can make the sampler's bits differ from the trainer's. (A decode
    step's projections then take two tiled GEMMs, not four.)"""
    pack = packed(mha, grad)
    if pack is not None:
        return pack.weight, pack.bias, pack.rows
    parts = _parts(mha, device_type=None)
    if parts is None:
        return None
    weights, biases = parts[:3], parts[3:]
    rows = (weights[0].shape[0], weights[1].shape[0], weights[2].shape[0])
    return torch.cat(weights), torch.cat(biases) if biases else None, rows  # (Nq + Nk + Nv, E), (Nq + Nk + Nv,)


def is_packed(mha: Layer) -> bool:
    """Whether the module's q, k, v weights and biases are the parameters its :class:`Pack`
    put in rows, and still lie there."""
    pack = mha.__dict__.get("_qkv")
    parts = _parts(mha)
    return (pack is not None and parts is not None and len(pack.params) == len(parts)
            and all(a is b for a, b in zip(pack.params, parts, strict=True))
            and pack.holds(_with_biases(parts)))


def before_apply(mha: Layer) -> tuple[int, ...] | None:
    """The q, k, v parameters' pointers before an ``_apply`` (``to()``, ``double()``,
    ``to_empty()``, ``share_memory()``, ...), for :func:`after_apply`."""
    parts = _parts(mha, device_type=None)
    return None if parts is None else tuple(p.data_ptr() for p in parts)


def after_apply(mha: Layer, before: tuple[int, ...] | None) -> None:
    """After an ``_apply``: where it gave every q, k, v parameter new memory (a conversion,
    which makes each weight on its own), put them in rows again; where they are not in rows
    then, drop the pack (its rows live on only in the parameters still there). An
    ``_apply`` that changed no pointer (``to()`` of the same dtype and device) moves no
    memory the user gave a weight."""
    parts = _parts(mha, device_type=None)
    if (before is not None and parts is not None and len(parts) == len(before)
            and all(p.data_ptr() != ptr for p, ptr in zip(parts, before, strict=True))):
        pack(mha)
    if not is_packed(mha):
        mha.__dict__.pop("_qkv", None)


def pack(mha: Layer) -> bool:
    """Put the q, k, v weights (and biases) in the rows of one new tensor each, values
    kept, where they can be: three plain ``nn.Linear`` on the CPU whose weights (and biases,
    on all three or none) are distinct ``nn.Parameter`` of one dtype, not in shared memory;
    else change nothing. Whether they are packed now.

    The parameters stay the same objects (``.data`` is re-pointed), so an optimizer or a
    wrapper that holds them keeps working. Call it only where the weights are the module's
    own (construction, after ``_apply`` converted them): it moves them to new memory.
    """
    if is_packed(mha):
        return True
    parts = _parts(mha)
    if parts is None or torch.compiler.is_compiling():
        return False
    rows = (parts[0].shape[0], parts[1].shape[0], parts[2].shape[0])
    pack = _put_in_rows(parts, rows)
    if pack is None:
        return False
    mha.__dict__["_qkv"] = pack  # not an attribute change: the memo stays
    return True


def after_load(mha: Layer, incompatible_keys) -> None:
    """A ``load_state_dict`` post-hook: a load copies into the rows, but one with
    ``assign=True`` replaces the parameters; then the pack is dropped, so that its rows
    live only as long as a parameter still lies in them."""
    if mha.__dict__.get("_qkv") is not None and not is_packed(mha):
        del mha.__dict__["_qkv"]


def _put_in_rows(params: tuple[nn.Parameter, ...], rows: tuple[int, int, int]) -> Pack | None:
    """Copy the three weights (then the three biases, if given) into one new tensor each,
    and point each parameter at its rows through a storage of its own; None (nothing
    changed) where a dtype has no DLPack form."""
    weights, biases = params[:3], params[3:]
    with torch.no_grad():
        weight = torch.cat(weights)  # (Nq + Nk + Nv, E): q, k, v rows stacked
        bias = torch.cat(biases) if biases else None  # (Nq + Nk + Nv,)
    parts = list(weight.split(rows)) + (list(bias.split(rows)) if bias is not None else [])  # (n, E) x 3, (n,) x 3
    try:  # a storage of exactly each part, over the whole tensor's memory
        aliases = [torch.from_dlpack(part) for part in parts]
    except (RuntimeError, TypeError, BufferError):
        return None
    for p, alias in zip(params, aliases, strict=True):
        p.data = alias  # the same Parameter, now over its rows
    return Pack(weight, bias, rows, tuple(params), tuple(w.shape for w in weights))


def _nothing() -> None:
    return None


def _with_biases(params: tuple[Tensor, ...]) -> tuple[Tensor | None, ...]:
    """Three weights and three biases, Nones where there are no biases."""
    return params if len(params) == 6 else (*params, None, None, None)


def _parts(mha: Layer, device_type: str | None = "cpu") -> tuple[nn.Parameter, ...] | None:
    """The three weights, then the three biases (where all have one), where :func:`pack` may
    put them in rows (on ``device_type``; None: on any device, shared memory included); else None."""
    modules: list[Any] = [mha._modules.get(name) for name in _NAMES]
    if not all(type(m) is nn.Linear for m in modules):
        return None
    # .get: weight_norm, prune and spectral_norm take "weight" out of the dict (a hook computes it)
    weights: list[Any] = [m._parameters.get("weight") for m in modules]
    biases: list[Any] = [m._parameters.get("bias") for m in modules]
    if any(w is None for w in weights) or (any(b is None for b in biases) and any(b is not None for b in biases)):
        return None
    params = tuple(weights + ([] if biases[0] is None else biases))
    first = weights[0]
    if (any(type(p) is not nn.Parameter or p.device != first.device or p.dtype != first.dtype for p in params)
            or (device_type is not None and first.device.type != device_type)
            or len({id(p) for p in params}) != len(params)
            or any(w.dim() != 2 or w.shape[1] != first.shape[1] for w in weights)
            or any(b is not None and b.shape != (w.shape[0],) for w, b in zip(weights, biases, strict=True))):
        return None
    if device_type == "cpu" and any(p.is_shared() for p in params):  # share_memory(): it stays there
        return None
    return params

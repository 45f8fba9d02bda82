"""A plain mask_mod traced on symbolic indices: the ops it applies to ``b``, ``h``, ``q_idx``
and ``kv_idx``, recorded as a small graph (:class:`Node`).

The function is called once with four :class:`Sym` tensors that record what is done to
them: comparisons, ``+ - * // %``, ``& | ^ ~``, ``abs``, ``where`` / ``minimum`` /
``maximum`` / ``clamp``, integer casts, and indexing a captured integer (or bool) tensor of
one or two dims by index values. Anything else (a float, a reduction, a reshape, reading a
shape, Python control flow on an index, ``.item()``) makes the function *opaque*:
:func:`trace` returns None and the caller evaluates it pair by pair, as before. The graph
is exact where it exists: it replays the same torch ops on the same captured tensors
(:func:`replay`), so :mod:`headwise.intervals` may prove a tile's value from it.

A 0-d captured tensor is read as its value when traced; every call traces anew, so a later
change of such a value (or of a Python number the function reads) is a new graph.

Legend: B batch, H query heads, S query length, Sk key length.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import Tensor

__all__ = ["Node", "Opaque", "Sym", "trace", "replay", "captured", "signature", "Memo", "forget"]

LIMIT = 1 << 31  # |values| the graph may reach: beyond it int32 (and the bounds' products) could wrap

_OPS = {  # torch's function names -> (the node's op, whether the two operands are swapped)
    **{n: ("add", False) for n in ("add", "__add__", "__radd__")},
    **{n: ("sub", False) for n in ("sub", "__sub__", "subtract")}, "__rsub__": ("sub", True), "rsub": ("sub", True),
    **{n: ("mul", False) for n in ("mul", "__mul__", "__rmul__", "multiply")},
    **{n: ("floordiv", False) for n in ("floor_divide", "__floordiv__")}, "__rfloordiv__": ("floordiv", True),
    **{n: ("mod", False) for n in ("remainder", "__mod__")}, "__rmod__": ("mod", True),
    **{n: ("min", False) for n in ("minimum",)}, **{n: ("max", False) for n in ("maximum",)},
    **{n: ("lt", False) for n in ("lt", "__lt__", "less")},
    **{n: ("le", False) for n in ("le", "__le__", "less_equal")},
    **{n: ("gt", False) for n in ("gt", "__gt__", "greater")},
    **{n: ("ge", False) for n in ("ge", "__ge__", "greater_equal")},
    **{n: ("eq", False) for n in ("eq", "__eq__")}, **{n: ("ne", False) for n in ("ne", "__ne__", "not_equal")},
    **{n: ("and", False) for n in ("__and__", "__rand__", "logical_and", "bitwise_and")},
    **{n: ("or", False) for n in ("__or__", "__ror__", "logical_or", "bitwise_or")},
    **{n: ("xor", False) for n in ("__xor__", "__rxor__", "logical_xor", "bitwise_xor")},
}
_UNARY = {**{n: "neg" for n in ("neg", "__neg__", "negative")}, **{n: "abs" for n in ("abs", "__abs__", "absolute")},
          **{n: "not" for n in ("__invert__", "logical_not", "bitwise_not")}}
_SAME = ("clone", "contiguous", "detach", "__pos__", "positive")  # ops that return their operand's values
_CASTS = {"long": torch.int64, "int": torch.int32, "bool": torch.bool}
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_LOGIC = ("and", "or", "xor")


class Opaque(BaseException):  # noqa: N818 - not an error: a BaseException so `except Exception` in a rule cannot hide it
    """The traced function did something the graph does not model."""


_state = threading.local()


def _opaque(why: str) -> Opaque:
    _state.opaque = True  # seen even where the rule catches BaseException itself
    return Opaque(why)


class Node:
    """One op of the graph. ``args`` holds Nodes, Python ints and, for ``index``, the captured
    tensor first; ``leaves`` the index arguments it reads (0 b, 1 h, 2 q_idx, 3 kv_idx)."""

    __slots__ = ("op", "args", "dtype", "leaves", "order")

    def __init__(self, op: str, args: tuple, dtype: torch.dtype, leaves: frozenset[int]):
        self.op, self.args, self.dtype, self.leaves = op, args, dtype, leaves
        self.order: list[Node] | None = None  # _walk's answer, once asked (a node never changes)


def _integer(dtype: torch.dtype) -> bool:
    return dtype == torch.bool or not (dtype.is_floating_point or dtype.is_complex)


def _operand(x: Any) -> Node:
    """A Sym's node or a constant (a Python int or bool, or the value of a 0-d integer tensor)."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, Tensor) and x.dim() == 0 and _integer(x.dtype):
        x = x.item()
    if isinstance(x, bool):
        return Node("const", (int(x),), torch.bool, frozenset())
    if isinstance(x, int) and -LIMIT < x < LIMIT:
        return Node("const", (x,), torch.int64, frozenset())
    raise _opaque(f"operand {type(x).__name__}")


def _node(op: str, args: tuple, dtype: torch.dtype) -> Node:
    leaves: frozenset[int] = frozenset().union(*(a.leaves for a in args if isinstance(a, Node)))
    return Node(op, args, dtype, leaves)


def _binary(op: str, a: Node, b: Node) -> Node:
    bools = (a.dtype == torch.bool, b.dtype == torch.bool)
    if op in _LOGIC:
        if not all(bools):
            raise _opaque(f"{op} on integers (bitwise)")
        return _node(op, (a, b), torch.bool)
    if op in _COMPARE:
        return _node(op, (a, b), torch.bool)
    if all(bools) or (op in ("floordiv", "mod") and any(bools)):
        raise _opaque(f"{op} on bools")
    if op in ("floordiv", "mod") and not (b.op == "const" and (b.args[0] > 0 if op == "mod" else b.args[0] != 0)):
        raise _opaque(f"{op} by a non-constant (or zero) divisor")
    dtype = torch.promote_types(a.dtype, b.dtype) if not any(bools) else (b.dtype if bools[0] else a.dtype)
    for const, other in ((a, b), (b, a)):
        if const.op == "const" and other.op != "const" and not any(bools):
            dtype = other.dtype  # a Python int takes the tensor's integer dtype, as in torch
    return _node(op, (a, b), dtype)


def _index(t: Tensor, index: Any) -> Node:
    """``t[i]`` (t 1-D) or ``t[i, j]`` (t 2-D) at integer index values."""
    parts = index if isinstance(index, tuple) else (index,)
    if isinstance(t, Sym) or not isinstance(t, Tensor) or t.dim() != len(parts) or t.dim() not in (1, 2):
        raise _opaque("indexing other than a captured 1-D or 2-D tensor by one index per dim")
    if not _integer(t.dtype) or t.is_sparse or t.requires_grad:
        raise _opaque(f"indexing a {t.dtype} tensor")
    nodes = tuple(_operand(p) for p in parts)
    if any(n.dtype == torch.bool for n in nodes) or not any(isinstance(p, Sym) for p in parts):
        raise _opaque("bool (masking) index")
    return _node("index", (t, *nodes), t.dtype)


def _where(cond: Any, a: Any, b: Any) -> Node:
    c, x, y = _operand(cond), _operand(a), _operand(b)
    if c.dtype != torch.bool or (x.dtype == torch.bool) != (y.dtype == torch.bool):
        raise _opaque("where with a non-bool condition or mixed bool / integer values")
    dtype = torch.bool if x.dtype == torch.bool else torch.promote_types(x.dtype, y.dtype)
    return _node("where", (c, x, y), dtype)


def _clamp(x: Any, min: Any = None, max: Any = None) -> Node:  # noqa: A002 - torch.clamp's keywords
    node = _operand(x)
    if node.dtype == torch.bool:
        raise _opaque("clamp of a bool")
    for op, bound in (("max", min), ("min", max)):  # torch.clamp: min(max(x, lo), hi)
        if bound is not None:
            node = _node(op, (node, _operand(bound)), node.dtype)
    return node


def _cast(x: Sym, dtype: Any) -> Node:
    if not isinstance(dtype, torch.dtype) or not _integer(dtype):
        raise _opaque(f"cast to {dtype}")
    if dtype == torch.bool and x.node.dtype != torch.bool:
        return _node("ne", (x.node, _operand(0)), torch.bool)
    if dtype != torch.bool and x.node.dtype == torch.bool:
        return _node("same", (x.node,), dtype)  # 0 / 1
    return _node("same", (x.node,), dtype)


def _to(x: Sym, *args: Any, **kwargs: Any) -> Node:
    """``.to(device)`` keeps the values; ``.to(dtype)`` casts; a device other than the call's is opaque."""
    dtype = kwargs.pop("dtype", None)
    for a in (*args, kwargs.pop("device", None)):
        if isinstance(a, torch.dtype):
            dtype = a
        elif a is not None and torch.device(a) != x.device_:
            raise _opaque("a move to another device")
    return x.node if dtype is None else _cast(x, dtype)


def _record(name: str, args: tuple, kwargs: dict) -> Node:
    """The node of one torch call on Syms (or Opaque)."""
    if name in _OPS and len(args) == 2 and not kwargs:
        op, swapped = _OPS[name]
        a, b = _operand(args[0]), _operand(args[1])
        return _binary(op, *((b, a) if swapped else (a, b)))
    if name in _UNARY and len(args) == 1 and not kwargs:
        node = _operand(args[0])
        if (name in ("__invert__", "bitwise_not")) != (node.dtype == torch.bool) and name != "logical_not":
            raise _opaque(f"{name} of a {node.dtype}")
        if name == "logical_not" and node.dtype != torch.bool:
            raise _opaque("logical_not of an integer")
        return _node(_UNARY[name], (node,), node.dtype)
    if name in ("div", "divide") and kwargs.get("rounding_mode") == "floor" and len(args) == 2:
        return _binary("floordiv", _operand(args[0]), _operand(args[1]))
    if name == "where" and len(args) + len(kwargs) == 3:
        return _where(*args, *kwargs.values())
    if name in ("clamp", "clip"):
        return _clamp(*args, **kwargs)
    if name == "__getitem__" and len(args) == 2:
        return _index(*args)
    if name in _SAME and isinstance(args[0], Sym) and not [k for k in kwargs if k != "memory_format"]:
        return args[0].node
    if name in _CASTS and len(args) == 1 and isinstance(args[0], Sym) and not kwargs:
        return _cast(args[0], _CASTS[name])
    if name == "to" and isinstance(args[0], Sym):
        return _to(args[0], *args[1:], **kwargs)
    raise _opaque(f"torch op {name}")


class Sym(Tensor):
    """An index argument (or a value computed from them) that records the ops applied to it.
    It has no storage; only its device and dtype may be read."""

    node: Node
    device_: torch.device

    @staticmethod
    def __new__(cls, node: Node, device: torch.device):
        r = Tensor._make_wrapper_subclass(cls, (1,), dtype=node.dtype, device=device)
        r.node, r.device_ = node, device
        return r

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name == "__get__":  # a property: the device and dtype are the index arguments' own
            prop, sym = getattr(func.__self__, "__name__", ""), args[0]
            if prop in ("device", "dtype", "is_cuda"):
                return {"device": sym.device_, "dtype": sym.node.dtype, "is_cuda": sym.device_.type == "cuda"}[prop]
            raise _opaque(f"reading .{prop}")
        flat = [*args, *(kwargs or {}).values()]
        flat += [a for t in flat if isinstance(t, tuple) for a in t]  # t[i, j]: the indices of a tuple
        device = next(a.device_ for a in flat if isinstance(a, Sym))
        return Sym(_record(name, tuple(args), dict(kwargs or {})), device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise _opaque(f"aten op {func}")  # an op __torch_function__ let through

    def __repr__(self) -> str:  # type: ignore[override]  # a rule that prints its arguments prints this while traced
        return f"Sym({self.node.op})"


def trace(mod: Any, device: torch.device | None = None) -> Node | None:
    """The graph of ``mod(b, h, q_idx, kv_idx)``, its result a bool; None where it is opaque
    (or raises: the caller's own evaluation then raises the function's error itself)."""
    device = torch.device("cpu") if device is None else torch.device(device)
    leaves = [Sym(Node("leaf", (i,), torch.int64, frozenset((i,))), device) for i in range(4)]
    _state.opaque = False
    try:
        out = mod(*leaves)
    except (Opaque, Exception):
        return None
    if _state.opaque:
        return None
    if isinstance(out, bool) or (type(out) is Tensor and out.dim() == 0 and out.dtype == torch.bool):
        return _operand(out)  # the same answer for every pair
    if not isinstance(out, Sym) or out.node.dtype != torch.bool:
        return None
    return out.node


def _walk(root: Node) -> list[Node]:
    """Every node once, operands before the ops that read them."""
    if root.order is None:
        root.order = _topological(root)
    return root.order


def _topological(root: Node) -> list[Node]:
    order: list[Node] = []
    seen: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in seen:
            continue
        seen.add(id(node))
        stack.append((node, True))
        stack.extend((a, False) for a in reversed(node.args) if isinstance(a, Node))
    return order


def captured(root: Node) -> list[Tensor]:
    """The captured tensors the graph indexes, in a fixed order."""
    found: list[Tensor] = []
    for node in _walk(root):
        if node.op == "index" and not any(node.args[0] is t for t in found):
            found.append(node.args[0])
    return found


def signature(root: Node, tensors: list[Tensor]) -> tuple:
    """The graph as a hashable key: its ops and constants, a captured tensor as its place in
    ``tensors`` with dtype, shape and device (its values are the cache's to compare)."""
    order = _walk(root)
    ids = {id(n): i for i, n in enumerate(order)}

    def arg(a: Any) -> Any:
        if isinstance(a, Node):
            return ("n", ids[id(a)])
        if isinstance(a, Tensor):
            at = next(i for i, t in enumerate(tensors) if t is a)
            return ("t", at, a.dtype, tuple(a.shape), str(a.device))
        return a

    return tuple((n.op, n.dtype, *(arg(a) for a in n.args)) for n in order)


def replay(root: Node, values: dict[int, Tensor]) -> Tensor:
    """The graph's exact values at index tensors ``values`` (leaf -> broadcasting int64 tensor):
    the function's own torch ops on the same captured tensors, replayed."""
    device = next(iter(values.values())).device
    out: dict[int, Any] = {}
    for node in _walk(root):
        a = [out[id(x)] if isinstance(x, Node) else x for x in node.args]
        if node.op == "leaf":
            out[id(node)] = values[a[0]]
        elif node.op == "const":
            out[id(node)] = torch.tensor(a[0], dtype=node.dtype, device=device)
        elif node.op == "index":
            out[id(node)] = a[0][tuple(a[1:])]
        elif node.op == "same":
            out[id(node)] = a[0].to(node.dtype)
        else:
            out[id(node)] = _REPLAY[node.op](*a)
    return out[id(root)]


_REPLAY: dict[str, Any] = {
    "add": torch.add, "sub": torch.sub, "mul": torch.mul, "floordiv": torch.floor_divide,
    "mod": torch.remainder, "min": torch.minimum, "max": torch.maximum, "neg": torch.neg, "abs": torch.abs,
    "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge, "eq": torch.eq, "ne": torch.ne,
    "and": torch.logical_and, "or": torch.logical_or, "xor": torch.logical_xor, "not": torch.logical_not,
    "where": torch.where,
}


# captured tensors up to this many elements are compared by value (a copy kept); larger by identity + version
COPY_MAX = 1 << 17


class Memo:
    """Results per graph :func:`signature` (and whatever else the key holds) that are served only
    while the captured tensors hold what they held: a small one compared by value (a copy is
    kept), a large one by identity and version counter (``tensor._version``, which every
    in-place op bumps). The least recently used of more than ``size`` keys is dropped."""

    def __init__(self, size: int):
        self.size, self.items = size, OrderedDict[tuple, tuple[list, Any]]()
        _MEMOS.add(self)

    def get(self, key: tuple, tensors: list[Tensor]) -> tuple[bool, Any]:
        """(True, the result) where the key is known and its tensors unchanged; (False, None) otherwise."""
        hit = self.items.get(key)
        if hit is None or not all(_unchanged(p, t) for p, t in zip(hit[0], tensors, strict=True)):
            return False, None
        self.items.move_to_end(key)
        return True, hit[1]

    def put(self, key: tuple, tensors: list[Tensor], value: Any) -> None:
        prints = [t.detach().clone() if t.numel() <= COPY_MAX else (weakref.ref(t), t._version) for t in tensors]
        self.items[key] = (prints, value)
        self.items.move_to_end(key)
        while len(self.items) > self.size:
            self.items.popitem(last=False)


_MEMOS: weakref.WeakSet[Memo] = weakref.WeakSet()


def forget() -> None:
    """Empty every :class:`Memo` (a benchmark's first call on new documents, each time)."""
    for memo in list(_MEMOS):
        memo.items.clear()


def _unchanged(print_: Any, t: Tensor) -> bool:
    if isinstance(print_, Tensor):
        return print_.dtype == t.dtype and torch.equal(print_, t)
    return print_[0]() is t and print_[1] == t._version

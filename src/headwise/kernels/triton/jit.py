"""The device code (:mod:`headwise.kernels.triton.tiles`, :mod:`headwise.kernels.triton.forward`,
:mod:`headwise.kernels.triton.backward`) as Triton kernels, or as the CPU interpreter's, made
on first use: Triton is imported here only when a kernel first runs, so ``import headwise``
never needs it.
"""

from __future__ import annotations

import functools
import types

from headwise.kernels.triton import backward, forward, tiles

# Every device function, by file; a kernel's calls resolve by name when it first runs, so order is free.
_DEVICE_CODE = (
    tiles._load_tile, tiles._store_tile, tiles._dot, tiles._lowp, tiles._mask_scores, tiles._key_tile_bounds,
    tiles._query_tile_bounds, tiles._tanh, tiles._capped, tiles._scores_at, tiles._tile_scores, tiles._tile_bits,
    forward._online_softmax, forward._fwd_inner, forward._fwd_rule, forward._fwd_kernel,
    backward._bwd_delta_kernel, backward._dkdv_step, backward._dkdv_inner, backward._dkdv_rule,
    backward._bwd_dkdv_kernel, backward._dq_step, backward._dq_inner, backward._dq_rule, backward._bwd_dq_kernel,
)


@functools.cache
def _compiled(interpret: bool) -> types.SimpleNamespace:
    """The device code as Triton kernels (``interpret``: as the CPU interpreter's functions).

    Each mode gets its own namespace, so the helpers the kernels call resolve to kernels of
    the same mode and nothing is written into this module's globals.
    """
    import triton
    import triton.language as tl

    jit = _interpreter_function() if interpret else triton.jit
    ns: dict = {"tl": tl, "triton": triton}
    for fn in _DEVICE_CODE:
        clone = types.FunctionType(fn.__code__, ns, fn.__name__, fn.__defaults__, fn.__closure__)
        # The annotations are strings (postponed evaluation); older Triton interpreters
        # recognise only the tl.constexpr object itself.
        clone.__annotations__ = {name: tl.constexpr if hint == "tl.constexpr" else hint
                                 for name, hint in fn.__annotations__.items()}
        clone.__module__, clone.__qualname__, clone.__doc__ = fn.__module__, fn.__qualname__, fn.__doc__
        ns[fn.__name__] = jit(clone)
    return types.SimpleNamespace(**{fn.__name__: ns[fn.__name__] for fn in _DEVICE_CODE})


@functools.cache
def _interpreter_function() -> type:
    """The CPU interpreter's function class, for the device code.

    The interpreter re-points ``triton.language``'s builtins to its own on every call of a
    device function, not only at a kernel's launch: a scan of the module with
    ``inspect.getmembers``, about a millisecond, for every helper call of every program of
    the grid, which the launch has already done (a quarter of the interpreter's time in
    ``tests/kernels/test_triton.py``). Inside a running kernel, where ``tl.load`` is the
    interpreter's already, a helper's call runs its rewritten code at once; elsewhere, and on
    a Triton whose interpreter lacks what this reads (then the class is the interpreter's
    own), it calls as the interpreter does.
    """
    import triton.language as tl
    from triton.runtime import interpreter

    base = interpreter.InterpretedFunction
    if not (hasattr(base, "rewrite") and hasattr(interpreter, "InterpreterError")):
        return base

    class Helper(base):  # type: ignore[misc, valid-type]
        def __call__(self, *args, **kwargs):
            if tl.core.is_builtin(tl.load):  # not inside a kernel: the interpreter patches, as always
                return super().__call__(*args, **kwargs)
            try:
                return self.rewrite()(*args, **kwargs)
            except Exception as error:
                raise interpreter.InterpreterError(repr(error)) from error

    return Helper

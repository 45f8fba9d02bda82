"""Attention kernels: q, k, v in, output out, one signature, one registry.

``BUILTIN`` is the one list of the built-in kernels, in the order listings show them;
each kernel module defines its ``KERNEL`` (the function and what it can do) and this
package adds them to the registry. :func:`register` adds your own.
"""

from headwise.kernels import bmm, chunked, einops_kernel, einsum, flex, invariant, matmul, sdpa, triton, varlen
from headwise.kernels.registry import Kernel, KernelResult, Request, add, get_kernel, kernels, register

__all__ = ["BUILTIN", "Kernel", "KernelResult", "Request", "get_kernel", "kernels", "register"]

BUILTIN: dict[str, Kernel] = {
    "bmm": bmm.KERNEL,
    "chunked": chunked.KERNEL,
    "einops": einops_kernel.KERNEL,
    "einsum": einsum.KERNEL,
    "flex": flex.KERNEL,
    "invariant": invariant.KERNEL,
    "matmul": matmul.KERNEL,
    "sdpa": sdpa.KERNEL,
    "triton": triton.KERNEL,
    "varlen": varlen.KERNEL,
}

for _kernel in BUILTIN.values():
    add(_kernel)

"""Attention kernels: q, k, v in, output out, one signature, one registry.

Importing this package registers every built-in kernel.
"""

from headwise.kernels import bmm, chunked, einops_kernel, einsum, matmul, sdpa, triton_flash, varlen  # noqa: F401
from headwise.kernels.registry import Kernel, Request, get_kernel, kernels, register

__all__ = ["Kernel", "Request", "get_kernel", "kernels", "register"]

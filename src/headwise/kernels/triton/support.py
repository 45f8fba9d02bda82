"""Where the triton kernel can run (triton installed; a CUDA GPU, or Triton's CPU interpreter
under ``TRITON_INTERPRET=1``) and what it refuses in a request, each refusal with its remedy.

Legend: B batch, Sk key length, D head dim, Dv value head dim.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from headwise.kernels.registry import Request

MAX_HEAD_DIM = 128
_INSTALL = "pip install 'headwise[triton]'"


def _interpreting() -> bool:
    """True when ``TRITON_INTERPRET`` asks for Triton's CPU interpreter (read on each call)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _interpreted(device: torch.device) -> bool:
    """CPU tensors can only go through Triton's interpreter; GPU tensors get compiled kernels."""
    return device.type == "cpu"



# Looked up once, at import: a find_spec walks sys.path (tens of microseconds), and dispatch
# asks on every new request shape (each decoding step is one). A constant, not a list filled
# on the first look-up: torch.compile traces this (dispatch runs inside the graph) and guards
# on what it reads, so a list that fills after the first compiled call recompiled the second.
_TRITON_INSTALLED = importlib.util.find_spec("triton") is not None


def _triton_installed() -> bool:
    return _TRITON_INSTALLED


def _available() -> str | None:
    if not _triton_installed():
        return f"triton is not installed ({_INSTALL})"
    if _interpreting() or torch.cuda.is_available():
        return None
    return ("needs a CUDA GPU; none is visible (set TRITON_INTERPRET=1 to run Triton's CPU "
            "interpreter, slowly, e.g. for tests)")


def _refuses(r: Request) -> str | None:
    if r.device.type != "cuda" and not (r.device.type == "cpu" and _interpreting()):
        return (f"runs on CUDA tensors, got device {str(r.device)!r}; move q, k, v to a GPU "
                "(or set TRITON_INTERPRET=1 to run CPU tensors through Triton's interpreter)")
    if r.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return (f"supports float16, bfloat16 and float32, got {r.dtype}; cast q, k, v or use "
                "backend 'chunked'")
    if r.device.type == "cuda" and r.dtype == torch.bfloat16:
        major, minor = torch.cuda.get_device_capability(r.device)
        if major < 8:
            return (f"bfloat16 needs compute capability >= 8.0, this GPU has {major}.{minor}; "
                    "use float16")
    if r.head_dim > MAX_HEAD_DIM:
        return f"supports head_dim <= {MAX_HEAD_DIM}, got {r.head_dim}; use backend 'sdpa' or 'chunked'"
    if r.mask_kind != "none" and not r.key_padding_only:
        return (f"takes key padding masks (B|1, 1, 1, Sk) only, got a mask of shape {r.mask_shape}; "
                "use backend 'sdpa' or 'chunked' for per-query or per-head masks")
    if r.dropout_p > 0:
        return f"has no dropout (dropout_p={r.dropout_p}); use backend 'sdpa' or 'chunked'"
    if r.own_value_dim:
        return (f"loads q, k and v tiles with one head-dim block (BLOCK_D), so v's head dim must be q's: got "
                f"Dv = {r.value_dim} != D = {r.head_dim}; use backend 'sdpa' or 'chunked'")
    if r.sink_tokens:
        return (f"skips key tiles by the window alone and has no sink tokens (sink_tokens={r.sink_tokens}); "
                "use backend 'sdpa' or 'chunked'")
    if r.score_mod == "additive":
        grad = " and its table's gradient" if r.score_mod_grad else ""
        return ("takes no dense score bias, only a key padding mask (one bias per key), so an additive score_mod "
                f"(a bias of b, h, q_idx and kv_idx) cannot reach its scores{grad}; use backend 'sdpa' (the bias "
                "as a float mask) or 'chunked'")
    if r.score_mod:
        grad = ", nor its gradient" if r.score_mod_grad else ""
        return ("runs one precompiled kernel, inside which a Python score_mod cannot run"
                f"{grad}; use backend 'chunked' (any score_mod, a block of rows at a time under autograd)")
    return None

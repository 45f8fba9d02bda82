"""The first document's tables of equivalent forms, measured instead of asserted.

For each step the document writes several ways (matmul vs ``@`` vs einsum vs bmm;
transpose vs permute vs swapaxes; view vs reshape vs flatten vs ``einops.rearrange``;
masked_fill vs an additive bias), this module runs every form on the same random
tensors and measures: does it need contiguous memory (it is tried on a non-contiguous
input), does it return a view (storage shared with its input), and how far is its
result from the first form's. Nothing in the table is typed in.

Legend: B batch, H heads, S sequence length, D head dim, E embed dim.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import einops
import torch
from torch import Tensor

__all__ = ["Row", "measure"]


@dataclass(frozen=True)
class Row:
    """One measured form.

    Attributes:
        group: the step, e.g. ``"weights x values"``.
        form: the code, as the document writes it.
        needs_contiguous: True when it fails on a non-contiguous input.
        view_of_contiguous: True when, on a contiguous input, the result shares its storage.
        view_of_noncontiguous: the same on a non-contiguous input (None: it failed there).
        max_diff: largest absolute difference from the group's first form (None: it failed).
        error: the first line of the error, for a form that failed on every input.
    """

    group: str
    form: str
    needs_contiguous: bool
    view_of_contiguous: bool | None
    view_of_noncontiguous: bool | None
    max_diff: float | None
    error: str | None = None


def _shares_storage(out: Tensor, inputs: tuple[Tensor, ...]) -> bool:
    ptr = out.untyped_storage().data_ptr()
    return any(ptr == t.untyped_storage().data_ptr() for t in inputs)


def _run(fn: Callable[..., Tensor], inputs: tuple[Tensor, ...]) -> tuple[Tensor | None, str | None]:
    try:
        return fn(*inputs), None
    except RuntimeError as exc:  # torch's shape / stride errors
        return None, str(exc).splitlines()[0]


def _group(name: str, forms: list[tuple[str, Callable[..., Tensor]]],
           contiguous: tuple[Tensor, ...], noncontiguous: tuple[Tensor, ...]) -> list[Row]:
    rows = []
    first: Tensor | None = None
    for form, fn in forms:
        out_c, err_c = _run(fn, contiguous)
        out_n, err_n = _run(fn, noncontiguous)
        result = out_n if out_n is not None else out_c
        if first is None:
            first = result
        diff = None
        if result is not None and first is not None and result.shape == first.shape:
            diff = (result - first).abs().max().item()
        rows.append(Row(
            group=name,
            form=form,
            needs_contiguous=out_c is not None and out_n is None,
            view_of_contiguous=None if out_c is None else _shares_storage(out_c, contiguous),
            view_of_noncontiguous=None if out_n is None else _shares_storage(out_n, noncontiguous),
            max_diff=diff,
            error=err_c if out_c is None else (err_n if out_n is None else None),
        ))
    return rows


def measure(seed: int = 0, B: int = 3, H: int = 8, S: int = 5, D: int = 16) -> list[Row]:
    """Run every form of every group on random tensors and measure the facts.

    Returns:
        The rows, grouped in the document's order.

    >>> rows = measure()
    >>> next(r for r in rows if r.form == "x.transpose(1, 2)").view_of_contiguous
    True
    """
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> Tensor:
        return torch.randn(*shape, generator=gen)

    def noncontig(t: Tensor) -> Tensor:
        # Same values laid out as the documents' split heads leave them: memory in
        # (B, S, H, D) order seen as (B, H, S, D) through transpose(1, 2).
        return t.transpose(1, 2).contiguous().transpose(1, 2)

    E = H * D
    weights = torch.softmax(rand(B, H, S, S), dim=-1)  # (B, H, S, Sk)
    values = rand(B, H, S, D)  # (B, H, Sk, D)
    mats = (weights, values)
    rows = _group("weights x values", [
        ("torch.matmul(w, v)", lambda w, v: torch.matmul(w, v)),
        ("w @ v", lambda w, v: w @ v),
        ("torch.einsum('bhij,bhjd->bhid', w, v)", lambda w, v: torch.einsum("bhij,bhjd->bhid", w, v)),
        ("torch.bmm(w.view(-1, S, S), v.view(-1, S, D)).view(B, H, S, D)",
         lambda w, v: torch.bmm(w.view(-1, S, S), v.view(-1, S, D)).view(B, H, S, D)),
        ("torch.matmul(w.unsqueeze(-2), v.unsqueeze(-1)).squeeze(-1)  (the document's)",
         lambda w, v: torch.matmul(w.unsqueeze(-2), v.unsqueeze(-1)).squeeze(-1)),
        ("(w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)",
         lambda w, v: (w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)),
    ], mats, tuple(noncontig(t) for t in mats))

    flat = rand(B, S, E)  # (B, S, E), a projection's output
    fused = rand(B, S, 3 * E)  # (B, S, 3E), a fused qkv projection
    fused[..., :E] = flat  # its q part holds the same values, but rows are 3E apart: not contiguous
    rows += _group("split heads (B, S, E) -> (B, H, S, D)", [
        ("x.view(B, S, H, D).transpose(1, 2)", lambda t: t.view(B, S, H, D).transpose(1, 2)),
        ("x.unflatten(-1, (H, D)).transpose(1, 2)", lambda t: t.unflatten(-1, (H, D)).transpose(1, 2)),
        ("x.reshape(B, S, H, D).permute(0, 2, 1, 3)", lambda t: t.reshape(B, S, H, D).permute(0, 2, 1, 3)),
        ("einops.rearrange(x, 'b s (h d) -> b h s d', h=H)",
         lambda t: einops.rearrange(t, "b s (h d) -> b h s d", h=H)),
    ], (flat,), (fused[..., :E],))

    x = rand(B, H, S, D)  # (B, H, S, D)
    rows += _group("swap heads and sequence", [
        ("x.transpose(1, 2)", lambda t: t.transpose(1, 2)),
        ("x.permute(0, 2, 1, 3)", lambda t: t.permute(0, 2, 1, 3)),
        ("x.swapaxes(1, 2)", lambda t: t.swapaxes(1, 2)),
    ], (x,), (noncontig(x),))

    merged_c = rand(B, S, H, D)  # (B, S, H, D), contiguous
    merged_n = rand(B, H, S, D).transpose(1, 2)  # (B, S, H, D) after transpose: not contiguous
    merged_n.copy_(merged_c)
    rows += _group("merge heads (B, S, H, D) -> (B, S, E)", [
        ("y.view(B, S, E)", lambda y: y.view(B, S, E)),
        ("y.contiguous().view(B, S, E)", lambda y: y.contiguous().view(B, S, E)),
        ("y.reshape(B, S, E)", lambda y: y.reshape(B, S, E)),
        ("y.flatten(2)", lambda y: y.flatten(2)),
        ("einops.rearrange(y, 'b s h d -> b s (h d)')",
         lambda y: einops.rearrange(y, "b s h d -> b s (h d)")),
    ], (merged_c,), (merged_n,))

    scores = rand(B, H, S, S)  # (B, H, S, Sk)
    pad = (torch.rand(B, 1, 1, S, generator=gen) > 0.3).long()  # (B, 1, 1, Sk), 1 = token
    pad[..., 0] = 1  # every row keeps a key, so the plain softmax stays finite
    rows += _group("mask then softmax", [
        ("softmax(s.masked_fill(mask == 0, -inf))",
         lambda s, m: torch.softmax(s.masked_fill(m == 0, float("-inf")), dim=-1)),
        ("softmax(s + zeros.masked_fill(mask == 0, -inf))  (additive bias)",
         lambda s, m: torch.softmax(s + torch.zeros(m.shape).masked_fill(m == 0, float("-inf")), -1)),
        ("softmax(torch.where(mask.bool(), s, -inf))",
         lambda s, m: torch.softmax(torch.where(m.bool(), s, float("-inf")), dim=-1)),
    ], (scores, pad), (noncontig(scores), pad))
    return rows

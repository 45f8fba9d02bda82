"""Rotary position embeddings (RoPE), applied to q and k inside attention.

Convention: the GPT-NeoX / Llama "rotate half" layout, so Hugging Face Llama weights
work unchanged: dimension ``i`` of the first half is paired with dimension ``i + D/2``,
and the pair at position ``p`` is rotated by the angle ``p * base ** (-2i / D)``:

    (x_i, x_{i+D/2}) -> (x_i cos a - x_{i+D/2} sin a,  x_i sin a + x_{i+D/2} cos a)

Partial rotary (``rotary_dim`` R < D, as GPT-NeoX and Phi do): only the first R dims
rotate, pairs ``(i, i + R/2)`` at ``p * base ** (-2i / R)``; dims R..D pass through.

Scaling follows Hugging Face's ``rope_parameters`` (transformers 5,
``modeling_rope_utils.ROPE_INIT_FUNCTIONS``), so a config's dict carries over:

- ``"default"``: the frequencies above.
- ``"linear"``: every frequency divided by ``factor`` (positions interpolated).
- ``"dynamic"`` (dynamic NTK): while a call's length L (its last position + 1) is at
  most ``max_position_embeddings``, the default frequencies; beyond it, the base grows to
  ``base * (factor * L / max_position_embeddings - (factor - 1)) ** (R / (R - 2))``.
- ``"llama3"``: Llama 3.1's: wavelengths above ``original_max_position_embeddings /
  low_freq_factor`` divided by ``factor``, below ``.. / high_freq_factor`` kept, smoothly
  blended in between.
- ``"yarn"``: YaRN's per-frequency blend of interpolation (``/ factor``) and
  extrapolation over the ramp set by ``beta_fast`` / ``beta_slow``, and cos / sin scaled
  by the attention factor (``attention_factor``, else ``0.1 * ln(factor) + 1``, or the
  ``mscale`` / ``mscale_all_dim`` ratio), which scales every score by its square.

Legend: B batch, H heads, S positions, D head dim, R rotated dims (``rotary_dim``), T
packed tokens, P positions asked for.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["ROPE_TYPES", "RotaryEmbedding", "apply_rotary"]

# rope_type: (required keys, optional keys) beside rope_type / rope_theta / partial_rotary_factor,
# as transformers' RotaryEmbeddingConfigMixin validates them. "max_position_embeddings" is the
# model config's own field, which dynamic NTK (and YaRN without a factor) read beside the dict.
ROPE_TYPES: Mapping[str, tuple[frozenset[str], frozenset[str]]] = {
    "default": (frozenset(), frozenset()),
    "linear": (frozenset({"factor"}), frozenset()),
    "dynamic": (frozenset({"factor", "max_position_embeddings"}), frozenset()),
    "llama3": (frozenset({"factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"}),
               frozenset()),
    "yarn": (frozenset({"factor", "original_max_position_embeddings"}),
             frozenset({"attention_factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "truncate",
                        "max_position_embeddings"})),
}
_COMMON_KEYS = frozenset({"rope_type", "type", "rope_theta", "partial_rotary_factor"})


def _rotate_half(x: Tensor) -> Tensor:
    first, second = x.chunk(2, dim=-1)  # (..., R/2) each
    return torch.cat((-second, first), dim=-1)  # (..., R)


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` (..., S, D) by angles whose cos/sin are (S, R), R <= D.

    The first R dims rotate in pairs ``(i, i + R/2)``; dims R..D pass through unchanged
    (partial rotary, as GPT-NeoX and Phi do). R = D rotates every dim.

    Args:
        x: (B, H, S, D), or packed (T, H, D) with cos/sin (T, 1, R).
        cos, sin: (S, R) from :meth:`RotaryEmbedding.angles` (or broadcastable).

    Returns:
        The rotated ``x``, same shape and dtype.

    >>> x = torch.randn(1, 2, 3, 8)
    >>> cos, sin = RotaryEmbedding(8, rotary_dim=4).angles(0, 3, x.dtype)
    >>> out = apply_rotary(x, cos, sin)
    >>> bool((out[..., 4:] == x[..., 4:]).all())  # dims 4..8 pass through
    True
    """
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin  # (B, H, S, D)
    rot, rest = x[..., :R], x[..., R:]  # (B, H, S, R), (B, H, S, D - R)
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)  # (B, H, S, D)


def _number(params: Mapping[str, Any], key: str, rope_type: str) -> float:
    value = params[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"rope_parameters[{key!r}] must be a number for rope_type {rope_type!r}, got {value!r}")
    return float(value)


class RotaryEmbedding(nn.Module):
    """Rotary position embedding for one head dim; no parameters.

    Args:
        head_dim: D (even unless only part of it rotates).
        base: the frequency base (None: ``scaling``'s ``rope_theta``, else 10000, RoPE's and
            Llama's). Given with a different ``rope_theta``, it is an error.
        rotary_dim: R, the leading dims that rotate (None: ``scaling``'s
            ``partial_rotary_factor`` x D, else D). An odd R rotates R + 1 dims, as Hugging
            Face does.
        scaling: a Hugging Face ``rope_parameters`` dict (``config.rope_parameters``):
            ``rope_type`` in :data:`ROPE_TYPES` and its keys, ``rope_theta`` and
            ``partial_rotary_factor`` optional. ``"dynamic"`` also needs
            ``max_position_embeddings`` (the model config's field of that name). None: no
            scaling.

    Attributes:
        rope_type: the scaling's ``rope_type`` (``"default"`` without one).
        attention_scaling: the factor cos and sin are multiplied by (YaRN's attention
            factor; 1.0 for the other types).

    Raises:
        ValueError: odd ``head_dim`` with every dim rotating, a non-positive base, a
            ``rotary_dim`` outside [1, D], an unknown ``rope_type``, missing or unused keys
            (named), or values that disagree.

    >>> rope = RotaryEmbedding(8)
    >>> q = torch.randn(1, 2, 3, 8)
    >>> rope(q, start=0).shape
    torch.Size([1, 2, 3, 8])
    >>> llama3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    ...           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    >>> RotaryEmbedding(64, scaling=llama3).inv_freq()[-1].item()  # the slowest pair: / factor
    3.76...e-07
    >>> yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}
    >>> round(RotaryEmbedding(64, scaling=yarn).attention_scaling, 4)  # 0.1 ln(4) + 1
    1.1386
    """

    def __init__(self, head_dim: int, base: float | None = None, *, rotary_dim: int | None = None,
                 scaling: Mapping[str, Any] | None = None):
        super().__init__()
        params = self._check_scaling(scaling)
        theta = params.pop("rope_theta", None)
        if theta is not None:
            theta = _number({"rope_theta": theta}, "rope_theta", params["rope_type"])
        if base is not None and theta is not None and float(base) != float(theta):
            raise ValueError(f"rope_base ({base:g}) and rope_parameters['rope_theta'] ({theta:g}) disagree; "
                             "give one of them")
        base = float(10000.0 if base is None and theta is None else base if base is not None else theta)
        if base <= 0:
            raise ValueError(f"rope_base must be positive, got {base:g}")
        fraction = params.pop("partial_rotary_factor", None)
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                raise ValueError(f"rope_parameters['partial_rotary_factor'] must be in (0, 1], got {fraction!r}")
            from_fraction = int(head_dim * fraction)  # transformers: dim = int(head_dim * partial_rotary_factor)
            if rotary_dim is not None and rotary_dim != from_fraction:
                raise ValueError(f"rotary_dim ({rotary_dim}) and partial_rotary_factor ({fraction:g}) x head_dim "
                                 f"({head_dim}) = {from_fraction} disagree; give one of them")
            rotary_dim = from_fraction
        if rotary_dim is None:
            if head_dim % 2:
                raise ValueError(f"rotary embeddings need an even head_dim, got {head_dim}")
            rotary_dim = head_dim
        if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int) or not 1 <= rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be an int in [1, head_dim = {head_dim}], got {rotary_dim!r}")
        if rotary_dim % 2 and rotary_dim + 1 > head_dim:
            raise ValueError(f"an odd rotary_dim ({rotary_dim}) rotates rotary_dim + 1 dims, more than head_dim "
                             f"({head_dim}); use an even rotary_dim")
        self.head_dim = head_dim
        self.base = base
        self.rotary_dim = rotary_dim
        self.rope_type: str = params.pop("rope_type")
        self.scaling: dict[str, Any] = params  # the type's own keys, checked
        self.attention_scaling = 1.0
        if self.rope_type == "dynamic" and rotary_dim <= 2:
            raise ValueError(f"dynamic NTK raises the base to R / (R - 2): rotary_dim must exceed 2, got {rotary_dim}")
        if self.rope_type == "yarn":
            self._init_yarn()

    @staticmethod
    def _check_scaling(scaling: Mapping[str, Any] | None) -> dict[str, Any]:
        """A copy of ``scaling`` with ``rope_type`` set, its keys checked against the type's."""
        if scaling is None:
            return {"rope_type": "default"}
        if not isinstance(scaling, Mapping):
            raise TypeError(f"rope_parameters must be a dict (Hugging Face's config.rope_parameters), got "
                            f"{type(scaling).__name__}")
        params = dict(scaling)
        if "type" in params:  # transformers' older spelling of rope_type
            kind = params.pop("type")
            params.setdefault("rope_type", kind)
        kind = params.setdefault("rope_type", "default")
        if kind not in ROPE_TYPES:
            raise ValueError(f"rope_type {kind!r} is not supported; choose one of {', '.join(map(repr, ROPE_TYPES))}")
        required, optional = ROPE_TYPES[kind]
        missing = sorted(required - params.keys())
        if missing:
            hint = ("; add the model config's max_position_embeddings: {**config.rope_parameters, "
                    "'max_position_embeddings': config.max_position_embeddings}"
                    if "max_position_embeddings" in missing else "")
            raise ValueError(f"rope_parameters for rope_type {kind!r} lack the keys {missing}{hint}")
        unused = sorted(params.keys() - required - optional - _COMMON_KEYS)
        if unused:
            known = sorted(required | optional | _COMMON_KEYS - {"type"})
            raise ValueError(f"rope_parameters keys {unused} are not used by rope_type {kind!r} (it reads {known}); "
                             "remove them")
        for key in sorted((required | optional) - {"truncate"}):
            if params.get(key) is None and (key in optional or (kind, key) == ("yarn", "factor")):
                continue  # transformers' defaults (YaRN's factor None: from the config's lengths)
            value = _number(params, key, kind)
            if value <= 0 and key not in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
                raise ValueError(f"rope_parameters[{key!r}] must be positive, got {value:g}")
        if kind == "llama3" and params["high_freq_factor"] <= params["low_freq_factor"]:
            raise ValueError(f"llama3 rope needs high_freq_factor ({params['high_freq_factor']:g}) > "
                             f"low_freq_factor ({params['low_freq_factor']:g})")
        return params

    def _init_yarn(self) -> None:
        """YaRN's factor (from the config's lengths when None) and attention factor."""
        p = self.scaling
        if p["factor"] is None:
            if p.get("max_position_embeddings") is None:
                raise ValueError("yarn rope with factor None takes it as max_position_embeddings / "
                                 "original_max_position_embeddings; add the key 'max_position_embeddings'")
            p["factor"] = p["max_position_embeddings"] / p["original_max_position_embeddings"]
        factor = float(p["factor"])

        def mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if p.get("attention_factor") is not None:
            self.attention_scaling = float(p["attention_factor"])
        elif p.get("mscale") and p.get("mscale_all_dim"):
            self.attention_scaling = mscale(factor, p["mscale"]) / mscale(factor, p["mscale_all_dim"])
        else:
            self.attention_scaling = mscale(factor)

    def extra_repr(self) -> str:
        rotary = f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else ""
        scaling = "".join(f", {k}={v:g}" if isinstance(v, float) else f", {k}={v!r}" for k, v in self.scaling.items())
        kind = f", rope_type={self.rope_type!r}" if self.rope_type != "default" else ""
        return f"head_dim={self.head_dim}, base={self.base:g}{rotary}{kind}{scaling}"

    def describe(self) -> str:
        """The rotation in words, for explain mode's rotary stage."""
        if self.rotary_dim == self.head_dim:
            rule = f"rotate q and k pairs (i, i + D/2) by position x {self.base:g}^(-2i/D)"
        else:
            R = 2 * ((self.rotary_dim + 1) // 2)
            rule = (f"rotate the first {R} of {self.head_dim} dims of q and k, pairs (i, i + {R // 2}), by position x "
                    f"{self.base:g}^(-2i/{self.rotary_dim}); dims {R}..{self.head_dim} pass through")
        if self.rope_type == "default":
            return rule
        params = ", ".join(f"{k}={v:g}" if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{k}={v}"
                           for k, v in self.scaling.items())
        rule += f"; {self.rope_type} scaling ({params})"
        if self.rope_type == "dynamic":
            rule += ", the base growing with the call's length"
        if self.attention_scaling != 1.0:
            rule += f"; cos and sin x attention factor {self.attention_scaling:.6g}"
        return rule

    def inv_freq(self, seq_len: int | Tensor | None = None, *, device: torch.device | None = None,
                 dtype: torch.dtype = torch.float64) -> Tensor:
        """The (ceil(R/2),) inverse frequencies, scaled as ``rope_type`` says.

        Args:
            seq_len: the call's length (its last position + 1); only ``"dynamic"`` reads it
                (an int, or a 0-d tensor, e.g. a static cache's position). None: the
                original length (no growth).
            device, dtype: where and in which precision to compute them.

        Returns:
            (ceil(R/2),) tensor: pair ``i`` turns by ``position x inv_freq[i]``.

        >>> RotaryEmbedding(4).inv_freq().tolist()
        [1.0, 0.01]
        """
        R = self.rotary_dim
        exponent = torch.arange(0, R, 2, device=device, dtype=dtype) / R  # (ceil(R/2),)
        p, kind = self.scaling, self.rope_type
        if kind == "dynamic":
            factor, longest = float(p["factor"]), float(p["max_position_embeddings"])
            L: float | Tensor = longest  # seq_len None: the original length, no growth
            if isinstance(seq_len, Tensor):
                L = seq_len.to(device=device, dtype=dtype).clamp_min(longest)  # () tensor: no host read
            elif seq_len is not None:
                L = max(float(seq_len), longest)
            base = self.base * (factor * L / longest - (factor - 1)) ** (R / (R - 2))
            return base ** -exponent  # (ceil(R/2),); at most the original length: the default ones
        inv = self.base ** -exponent  # (ceil(R/2),)
        if kind == "linear":
            inv = inv / float(p["factor"])
        elif kind == "llama3":
            factor, old = float(p["factor"]), float(p["original_max_position_embeddings"])
            low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
            wavelen = 2 * math.pi / inv
            scaled = torch.where(wavelen > old / low, inv / factor, inv)  # long wavelengths: interpolate
            smooth = (old / wavelen - low) / (high - low)
            blended = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= old / high) & (wavelen <= old / low)
            inv = torch.where(medium, blended, scaled)
        elif kind == "yarn":
            inv = self._yarn(inv, device, dtype)
        return inv

    def _yarn(self, extrapolated: Tensor, device: torch.device | None, dtype: torch.dtype) -> Tensor:
        p, R = self.scaling, self.rotary_dim
        factor, old = float(p["factor"]), float(p["original_max_position_embeddings"])
        beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1  # transformers' `or` defaults

        def correction_dim(rotations: float) -> float:  # the dim that turns `rotations` times over `old`
            return R * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low, high = correction_dim(beta_fast), correction_dim(beta_slow)
        if p.get("truncate", True):
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, R - 1)
        if low == high:
            high += 0.001  # transformers' guard against a zero-width ramp
        ramp = ((torch.arange(extrapolated.shape[0], device=device, dtype=dtype) - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp  # 1: extrapolate (high frequencies), 0: interpolate (low frequencies)
        return extrapolated / factor * (1 - keep) + extrapolated * keep  # (R/2,)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype,
                seq_len: int | Tensor | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (P, R') at integer ``positions`` (P,), R' = 2 * ceil(R/2).

        Angles are computed in float32 (float64 for float64 inputs), scaled by
        :attr:`attention_scaling`, then cast to ``dtype``.

        Args:
            positions: (P,) integer positions, on the device to compute on.
            dtype: the dtype of the q/k they will rotate.
            seq_len: the call's length for ``"dynamic"`` (None: ``positions.max() + 1``,
                which reads a value).

        Returns:
            ``(cos, sin)``, each (P, R').
        """
        calc = torch.float64 if dtype == torch.float64 else torch.float32
        if seq_len is None and self.rope_type == "dynamic":
            seq_len = int(positions.max()) + 1 if positions.numel() else 0
        inv_freq = self.inv_freq(seq_len, device=positions.device, dtype=calc)  # (R'/2,)
        freqs = positions.to(calc)[:, None] * inv_freq[None, :]  # (P, 1) x (1, R'/2) -> (P, R'/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (P, R'): pair i with i + R'/2
        cos, sin = emb.cos(), emb.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def angles(self, start: int, length: int, dtype: torch.dtype,
               device: torch.device | None = None, *, seq_len: int | None = None) -> tuple[Tensor, Tensor]:
        """cos and sin (S, R') for positions ``start .. start + length - 1``.

        Angles are computed in float32 (float64 for float64 inputs), then cast. ``seq_len``
        (None: ``start + length``) is the call's length, which ``"dynamic"`` scales by.
        """
        positions = torch.arange(start, start + length, device=device)  # (S,)
        return self.cos_sin(positions, dtype, start + length if seq_len is None else seq_len)

    def at(self, x: Tensor, positions: Tensor, *, seq_len: int | None = None) -> Tensor:
        """Rotate packed ``x`` (T, H, D) whose tokens sit at ``positions`` (T,).

        ``seq_len`` (None: the last position + 1, read only by ``"dynamic"``) is the length
        ``"dynamic"`` scales by.
        """
        cos, sin = self.cos_sin(positions, x.dtype, seq_len)  # (T, R')
        return apply_rotary(x, cos[:, None], sin[:, None])  # (T, H, D) with (T, 1, R')

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        """Rotate ``x`` (B, H, S, D) as if its positions were ``start .. start + S - 1``."""
        cos, sin = self.angles(start, x.shape[-2], x.dtype, x.device)
        return apply_rotary(x, cos, sin)

"""Run Hugging Face transformers models' attention through headwise.

Legend: B batch, H query heads, Hkv key/value heads, S query length, Sk key length,
D head dim.

``register()`` adds ``"headwise"`` to transformers' attention-function registry
(``AttentionInterface``) and to its mask-function registry (``AttentionMaskInterface``),
so any model built on that registry (BERT and Llama families among them) runs with::

    from headwise.integrations.transformers import register
    register()
    model = AutoModel.from_pretrained(path, attn_implementation="headwise")

How transformers' call contract (transformers 5.x, the one ``sdpa_attention_forward``
follows) maps onto :func:`headwise.attention`:

* ``query`` (B, H, S, D), ``key``/``value`` (B, Hkv, Sk, D): passed as they are;
  grouped-query attention (Hkv < H) runs natively, without repeating k/v heads.
* The mask: the registered mask function is headwise's
  (:func:`~headwise.integrations.transformers_masks.headwise_mask`), so a model hands over
  ``None`` or a :class:`~headwise.integrations.transformers_masks.TransformersMask`: the
  mask's rules, not a dense mask. It becomes ``is_causal`` / ``window`` where the causal
  rule is aligned bottom-right, a (B, 1, 1, Sk) bool ``attention_mask`` of real keys, and a
  ``mask_mod`` for the rest (documents of a packed row, chunks, a static cache's offset).
  A dense (B, 1, S, Sk) bool mask (models with their own ``vmap`` overlays, models that build
  their own) is taken as it is, True = attend: headwise's contract exactly. A floating 4-D
  mask (a custom one, or a model that builds its own) is additive in both libraries, but
  transformers blocks with ``torch.finfo(dtype).min`` where headwise blocks with ``-inf``:
  every value at or below ``finfo.min / 2`` is read as a block (no real bias comes within
  1e38 of it, and a bias added to ``finfo.min`` stays below the threshold). So a row with
  nothing to attend outputs zeros, as everywhere in headwise, instead of eager attention's
  uniform average over blocked keys; rows with something to attend are unchanged
  (``exp(finfo.min - max)`` is 0).
* Causality with a dense mask or none: as in ``sdpa_attention_forward``, the ``is_causal``
  flag (from the call, else ``module.is_causal``) applies only when no mask is given and
  S > 1; transformers builds a mask whenever causality needs more than that. When S < Sk
  in that case (an empty static cache being prefilled), keys past S are unfilled slots and
  are dropped, as SDPA does.
* ``dropout`` (transformers passes 0.0 in eval mode) becomes ``dropout_p``.
* ``output_attentions``: the call's flag, else ``module.config.output_attentions``; the
  returned (B, H, S, Sk) weights are the probabilities *before* dropout (eager returns
  them after dropout; the two agree in eval mode).
* ``position_bias`` (B|1, H, S, Sk), for models with learned relative positions, is
  folded into a floating mask.
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``) becomes ``softcap=``: the scaled
  scores are capped with ``softcap * tanh(s / softcap)`` before the mask, as Gemma 2's
  eager attention does; "auto" then runs a kernel that can cap (not SDPA).
* ``s_aux`` (gpt-oss passes its module's ``sinks`` parameter, (H,)) becomes ``sinks=``:
  one more softmax column per head that adds nothing to the output, as gpt-oss's eager
  attention concatenates and drops it. A row with nothing else to attend gives zeros.
* ``sliding_window`` is read from the mask (transformers builds sliding-window masks for
  the layers that have one, and chunked ones for Llama 4's chunked layers) and ``scaling``
  is the ``scale=``.
* Returns ``(attn_output (B, S, H, D), attn_weights or None)``.
"""

from __future__ import annotations

import logging
from typing import overload

import torch
from torch import Tensor, nn

from headwise.functional import attention
from headwise.integrations.transformers_masks import TransformersMask, headwise_mask
from headwise.kernels.registry import get_kernel

__all__ = ["register", "headwise_attention_forward", "hf_mask_to_headwise", "MIN_TRANSFORMERS"]

logger = logging.getLogger(__name__)

MIN_TRANSFORMERS = (5, 0)
_INSTALL = 'pip install "headwise[hf]"'


def _transformers():
    """The transformers module, or an ImportError that says how to get a usable one."""
    try:
        import transformers
    except ImportError:
        raise ImportError(
            f"headwise's Hugging Face integration needs transformers>=5, which is not installed; "
            f"install the hf extra: {_INSTALL}"
        ) from None
    version = transformers.__version__
    major_minor = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if major_minor < MIN_TRANSFORMERS:
        raise ImportError(
            f"transformers {version} is installed, but headwise's integration needs transformers>=5 "
            f"(its AttentionInterface call contract); upgrade with {_INSTALL} --upgrade"
        )
    return transformers


@overload
def hf_mask_to_headwise(attention_mask: Tensor) -> Tensor: ...


@overload
def hf_mask_to_headwise(attention_mask: None) -> None: ...


def hf_mask_to_headwise(attention_mask: Tensor | None) -> Tensor | None:
    """Translate a transformers attention mask into headwise's mask contract.

    Bool masks mean the same in both (True = attend) and pass through. Floating masks are
    additive in both; values at or below ``torch.finfo(dtype).min / 2`` (transformers'
    "blocked") become ``-inf`` (headwise's).

    Args:
        attention_mask: ``None``, bool, or floating, any shape.

    Returns:
        The mask in headwise's contract, same shape.

    >>> m = torch.tensor([0.0, torch.finfo(torch.float32).min, -2.0])
    >>> hf_mask_to_headwise(m).tolist()
    [0.0, -inf, -2.0]
    """
    if attention_mask is None or not attention_mask.is_floating_point():
        return attention_mask
    floor = torch.finfo(attention_mask.dtype).min / 2
    return attention_mask.masked_fill(attention_mask <= floor, float("-inf"))


def _fold_position_bias(position_bias: Tensor, mask: Tensor | None) -> Tensor:
    """One additive mask from a (B|1, H, S, Sk) position bias and a headwise mask."""
    if mask is None:
        return position_bias
    if mask.dtype == torch.bool:
        return position_bias.masked_fill(~mask, float("-inf"))
    return position_bias + mask.to(position_bias.dtype)


def _dense_rules(module: nn.Module, attention_mask: Tensor | None, is_causal: bool | None, S: int,
                 Sk: int) -> dict:
    """headwise's mask arguments for a dense mask (or None) from transformers, as
    ``sdpa_attention_forward`` reads them; ``crop``: keys past S are an empty static cache's slots."""
    causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
    causal = bool(causal) and attention_mask is None and S > 1  # a mask already holds causality
    return {"attention_mask": hf_mask_to_headwise(attention_mask), "is_causal": causal, "window": None,
            "mask_mod": None, "crop": causal and Sk > S}


def headwise_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,  # None: 1 / sqrt(D)
    is_causal: bool | None = None,  # None: module.is_causal (True if the module has none)
    position_bias: Tensor | None = None,  # None: no learned relative-position bias
    *,
    backend: str = "auto",
    **kwargs,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature, computed by :func:`headwise.attention`.

    Args:
        module: the calling attention layer (read for ``is_causal`` and ``config``).
        query: (B, H, S, D).
        key: (B, Hkv, Sk, D).
        value: (B, Hkv, Sk, D).
        attention_mask: None, a ``TransformersMask`` (from the registered mask function),
            or (B|1, 1|H, S, Sk) bool (True = attend) or floating (additive; ``finfo.min`` blocks).
        dropout: dropout probability on the attention weights.
        scaling: multiplier of ``q k^T``.
        is_causal: causal flag, honoured when no mask is given and S > 1.
        position_bias: (B|1, H, S, Sk) additive bias.
        backend: headwise backend (``register(backend=...)`` fixes it).
        **kwargs: transformers' extra keyword arguments; ``output_attentions``,
            ``softcap`` (logit soft-capping) and ``s_aux`` ((H,) sink logits) are read, the
            rest (``sliding_window``, ...) are already in the mask.

    Returns:
        ``(attn_output (B, S, H, D), attn_weights (B, H, S, Sk) or None)``; with ``s_aux``
        the weights' rows sum to less than 1 (the sink holds the rest).

    Raises:
        ValueError: anything :func:`headwise.attention` refuses.
    """
    S, Sk = query.shape[2], key.shape[2]
    output_attentions = kwargs.get("output_attentions")
    if output_attentions is None:
        output_attentions = getattr(getattr(module, "config", None), "output_attentions", False)
    if isinstance(attention_mask, TransformersMask):  # headwise's own mask builder: rules, no dense mask
        rules = attention_mask.attention_kwargs(query.shape[0], S, Sk)
    else:
        rules = _dense_rules(module, attention_mask, is_causal, S, Sk)
        if rules.pop("crop"):  # an empty static cache being prefilled: slots past S are unfilled
            key, value = key[:, :, :S], value[:, :, :S]  # (B, Hkv, S, D)
            position_bias = None if position_bias is None else position_bias[..., :S]  # (B|1, H, S, S)
    if position_bias is not None:
        rules["attention_mask"] = _fold_position_bias(hf_mask_to_headwise(position_bias), rules["attention_mask"])
    result = attention(
        query, key, value, rules.pop("attention_mask"),
        **rules,
        dropout_p=float(dropout),
        scale=scaling,
        backend=backend,
        need_weights=bool(output_attentions),
        softcap=kwargs.get("softcap"),
        sinks=kwargs.get("s_aux"),
    )
    out, weights = result if isinstance(result, tuple) else (result, None)  # (B, H, S, D), (B, H, S, Sk)
    return out.transpose(1, 2).contiguous(), weights  # (B, H, S, D) -> (B, S, H, D)


def register(name: str = "headwise", *, backend: str = "auto") -> str:
    """Make ``attn_implementation=name`` run attention through headwise.

    Registers an attention function in transformers' ``AttentionInterface`` and
    :func:`~headwise.integrations.transformers_masks.headwise_mask` under the same name in its
    ``AttentionMaskInterface``: models then hand the attention function the mask's rules (a
    :class:`~headwise.integrations.transformers_masks.TransformersMask`), not a dense
    (B, 1, S, Sk) mask; without a mask function transformers would build no padding or causal
    mask at all. Calling it again is harmless.

    Args:
        name: the ``attn_implementation`` name to register.
        backend: the headwise backend the registered function runs (``"auto"`` or a name
            from :func:`headwise.available_backends`), e.g. ``register("headwise_chunked",
            backend="chunked")`` for O(S) attention memory.

    Returns:
        ``name``, to pass as ``attn_implementation``.

    Raises:
        ImportError: transformers>=5 is not installed (the ``hf`` extra).
        ValueError: an empty name, or an unknown backend.

    >>> from transformers import LlamaConfig, LlamaModel
    >>> config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
    ...                      num_key_value_heads=2, vocab_size=50)
    >>> LlamaModel._from_config(config, attn_implementation=register()).config._attn_implementation
    'headwise'
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if backend != "auto":
        get_kernel(backend)  # ValueError listing the known backends
    _transformers()
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    def forward(module, query, key, value, attention_mask, *args, **kwargs):
        return headwise_attention_forward(module, query, key, value, attention_mask, *args,
                                          backend=backend, **kwargs)

    forward.__name__ = forward.__qualname__ = f"headwise_attention_forward_{backend}"
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, headwise_mask)
    logger.debug("registered attn_implementation=%r (headwise backend %r)", name, backend)
    return name

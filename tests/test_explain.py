"""explain(): one configuration traced, its weights and its mask picture data."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from headwise.explain import ExplainConfig, command, explain, markdown_page

DOCS = Path(__file__).resolve().parents[1] / "docs" / "how-attention-works.md"


def test_default_is_the_second_document_example():
    e = explain(ExplainConfig())
    assert e.output.shape == (4, 10, 512)
    assert e.weights.shape == (4, 8, 10, 10)
    assert [s.shape for s in e.trace.stages if s.name == "split heads q"] == [(4, 8, 10, 64)]


def test_lengths_causal_and_groups():
    e = explain(ExplainConfig(batch=2, seq=5, dim=32, heads=4, lengths=(5, 2), causal=True, kv_heads=2))
    assert e.allowed[1].int().tolist()[4] == [1, 1, 0, 0, 0]  # padding after 2 tokens
    assert e.allowed[0].int().tolist()[1] == [1, 1, 0, 0, 0]  # causal
    assert torch.all(e.weights[~e.allowed[:, None].expand_as(e.weights)] == 0)
    real = torch.arange(5)[None, :] < torch.tensor([5, 2])[:, None]  # (B, S) query rows that are tokens
    sums = e.weights.sum(-1).transpose(1, 2)  # (B, S, H)
    torch.testing.assert_close(sums[real], torch.ones(7, 4))  # padded query rows: the module's contract


def test_softcap_and_sinks_configuration():
    config = ExplainConfig(batch=2, seq=5, dim=32, heads=4, lengths=(5, 2), causal=True, softcap=2.0, sinks=True)
    e = explain(config)
    names = e.trace.names()
    assert names[names.index("scores"):names.index("softmax") + 1] == ["scores", "softcap", "mask", "sinks", "softmax"]
    live = e.allowed[:, None].expand_as(e.weights).any(-1)  # (B, H, S) rows with a key
    assert (e.weights.sum(-1)[live] < 1).all()  # the sinks hold the rest
    assert explain(config).weights.equal(e.weights)  # the sink logits come from the seed
    assert not explain(ExplainConfig(**{**config.__dict__, "seed": 1})).weights.equal(e.weights)
    assert command(config) == ("headwise explain --batch 2 --seq 5 --dim 32 --heads 4 --mask lengths 5,2 --causal "
                               "--softcap 2 --sinks")


@pytest.mark.parametrize(("changes", "message"), [
    ({"lengths": (3,)}, r"gives 1 lengths for --batch 4"),
    ({"lengths": (3, 4, 11, 2)}, r"\[11\] are outside \[0, --seq 10\]"),
    ({"heads": 0}, r"--heads must be positive"),
    ({"heads": 7}, r"num_heads \(7\) must divide embed_dim \(512\)"),
    ({"softcap": 0.0}, r"--softcap must be > 0 \(Gemma 2 uses 50\), got 0.0"),
])
def test_bad_configurations_raise(changes, message):
    with pytest.raises(ValueError, match=message):
        explain(ExplainConfig(**changes))


def test_command_round_trip():
    assert command(ExplainConfig()) == "headwise explain"
    assert command(ExplainConfig(heads=4, lengths=(1, 2), causal=True)) == (
        "headwise explain --heads 4 --mask lengths 1,2 --causal")


def test_docs_page_is_current():
    """The docs page is generated from the trace; regenerate it if this fails:
    headwise explain --mask lengths 10,7,3,5 --markdown > docs/how-attention-works.md"""
    page = markdown_page(explain(ExplainConfig(lengths=(10, 7, 3, 5))))
    assert DOCS.read_text() == page


@pytest.mark.parametrize(("size", "limit_seq"), [({"seq": 3000}, 1923), ({"seq": 600, "batch": 64}, 399)])
def test_a_size_explain_cannot_hold_is_refused_with_the_limit(size, limit_seq):
    with pytest.raises(ValueError, match=rf"needs about [0-9.]+ GiB, over the 2 GiB limit; lower --seq \(at most "
                       rf"{limit_seq} at"):
        ExplainConfig(**size).validate()
    ExplainConfig(**{**size, "seq": limit_seq}).validate()  # the size it names fits


def test_a_rule_is_traced_drawn_in_the_mask_and_mapped_in_tiles():
    config = ExplainConfig(batch=2, seq=12, dim=32, heads=2, causal=True, rule="document:4,5,3", backend="auto")
    e = explain(config)
    ids = torch.tensor([0] * 4 + [1] * 5 + [2] * 3)
    want = (ids[:, None] == ids[None, :]) & torch.ones(12, 12, dtype=torch.bool).tril()
    assert torch.equal(e.allowed, want.expand(2, 12, 12))
    assert (e.weights.masked_fill(want, 0) == 0).all()  # no weight outside the rule
    torch.testing.assert_close(e.weights.sum(-1), torch.ones(2, 2, 12))
    assert e.tiles is not None and e.tiles.states[0, 0].tolist() == [[1, 0, 0], [0, 1, 0], [0, 1, 1]]
    assert "rules" in e.trace.names() and command(config).endswith("--causal --rule document:4,5,3")
    for rule, message in (("document:4,4", "lengths summing to --seq 12"), ("prefix:13", "prefix:N"),
                          ("window:0", "window:W"), ("tiles:3", "is not a rule explain knows")):
        with pytest.raises(ValueError, match=message):
            explain(ExplainConfig(seq=12, rule=rule))
    with pytest.raises(ValueError, match="--tile must be >= 1"):
        explain(ExplainConfig(rule="window:2", tile=0))

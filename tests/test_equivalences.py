"""The documents' equivalent forms: the facts come from measurement."""

from __future__ import annotations

from headwise.equivalences import measure

ROWS = {row.form: row for row in measure()}


def test_every_group_agrees_numerically():
    for row in ROWS.values():
        if row.max_diff is not None:
            assert row.max_diff < 1e-5, row


def test_measured_contiguity_and_views():
    assert ROWS["x.transpose(1, 2)"].view_of_contiguous
    assert ROWS["x.permute(0, 2, 1, 3)"].view_of_noncontiguous
    assert ROWS["y.view(B, S, E)"].needs_contiguous
    assert "view size is not compatible" in ROWS["y.view(B, S, E)"].error
    reshape = ROWS["y.reshape(B, S, E)"]
    assert not reshape.needs_contiguous and reshape.view_of_contiguous and not reshape.view_of_noncontiguous
    assert not ROWS["torch.matmul(w, v)"].view_of_contiguous
    bmm = next(r for f, r in ROWS.items() if f.startswith("torch.bmm"))
    assert bmm.needs_contiguous  # bmm's .view needs the layout split heads does not give


def test_splitting_heads_is_a_view_even_of_a_fused_projection():
    forms = [f for f in ROWS if ROWS[f].group.startswith("split heads")]
    assert len(forms) == 4
    for form in forms:  # the module's unflatten + transpose among them: no copy on either layout
        assert ROWS[form].view_of_contiguous and ROWS[form].view_of_noncontiguous, form
        assert ROWS[form].max_diff is not None and ROWS[form].max_diff == 0


def test_document_unsqueeze_form_is_reported_as_failing():
    doc = next(r for f, r in ROWS.items() if "(the document's)" in f)
    assert doc.max_diff is None and doc.view_of_contiguous is None and doc.error
    fixed = ROWS["(w.unsqueeze(-1) * v.unsqueeze(-3)).sum(-2)"]
    assert fixed.max_diff is not None and fixed.max_diff < 1e-5

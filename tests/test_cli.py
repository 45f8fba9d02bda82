"""The command line, called through main(argv) as a user's shell would."""

from __future__ import annotations

import re

import pytest

import headwise
from headwise.cli import main


def test_demo_shows_masks_shapes_and_every_backend(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "(3, 1, 1, 2)" in out and "(3, 8, 2, 2)" in out  # mask before/after expansion
    assert "(3, 2, 128)" in out  # output shape
    for name in ["auto", *headwise.available_backends()]:
        row = re.search(rf"│ {name}\s+│ \(3, 2, 128\)\s+│\s+([0-9.e+-]+) │", out)
        assert row, f"no row for {name}"
        assert float(row.group(1)) < 1e-5  # every backend agrees with the document's class


def test_help_exits_zero(capsys):
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out
    assert main(["demo", "--help"]) == 0


@pytest.mark.parametrize("argv", [[], ["nonsense"], ["demo", "--seed", "x"]])
def test_bad_arguments_exit_nonzero_with_one_line(argv, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "error:" in err.splitlines()[-1]

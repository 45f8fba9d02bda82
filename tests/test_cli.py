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
    for name in ["auto", "packing=True", *headwise.available_backends()]:
        row = re.search(rf"│ {re.escape(name)}\s+│ \(3, 2, 128\)\s+│\s+([0-9.e+-]+) │ yes", out)
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


def test_demo_prints_the_stage_table(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "stage by stage" in out
    for stage in ("scores", "scaling", "softmax", "weighted sum", "merge heads", "(3, 8, 2, 2)"):
        assert stage in out


def test_explain_default_and_options(capsys):
    assert main(["explain"]) == 0
    assert "(4, 8, 10, 64)" in capsys.readouterr().out
    assert main(["explain", "--batch", "2", "--seq", "6", "--dim", "64", "--heads", "4",
                 "--mask", "lengths", "6,3", "--causal", "--kv-heads", "2"]) == 0
    out = capsys.readouterr().out
    assert "repeat kv heads" in out and "causal" in out and "(2, 2, 6, 16)" in out


def test_explain_shows_softcap_and_sinks_stage_by_stage(capsys):
    argv = ["explain", "--batch", "2", "--seq", "4", "--dim", "32", "--heads", "4", "--mask", "lengths", "4,2",
            "--causal", "--softcap", "5", "--sinks"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "softcap=5 sinks, backend 'matmul'" in out
    assert "softcap * tanh(scores / softcap), softcap = 5" in out
    assert "(2, 4, 4, 5)" in out and "one sink column per head appended as key 4" in out  # (B, H, S, Sk + 1)
    assert main([*argv, "--backend", "auto"]) == 0
    assert "softcap 5, mask, sinks, softmax, weighted sum tile by tile" in capsys.readouterr().out  # chunked


def test_explain_plot_writes_a_real_png_of_the_right_size(tmp_path, capsys):
    from headwise.plot import figure_size

    path = tmp_path / "weights.png"
    assert main(["explain", "--heads", "8", "--mask", "lengths", "10,7,3,5", "--plot", str(path)]) == 0
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == figure_size(8)
    assert "batch row 2" in capsys.readouterr().out  # the most padded row by default


def test_equivalences_table(capsys):
    assert main(["equivalences"]) == 0
    out = capsys.readouterr().out
    for form in ("torch.einsum", "x.swapaxes(1, 2)", "einops.rearrange", "masked_fill"):
        assert form in out
    assert "fails" in out  # the document's unsqueeze form and a bare view after transpose


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "--mask", "lengths", "1,2"], "gives 2 lengths for --batch 4"),
    (["explain", "--mask", "widths", "1,2,3,4"], "--mask kind must be 'lengths'"),
    (["explain", "--mask", "lengths", "a,b"], "comma-separated integers"),
    (["explain", "--heads", "7"], "num_heads (7) must divide embed_dim (512)"),
    (["explain", "--plot-batch", "9", "--plot", "x.png"], "--plot-batch 9 is outside"),
    (["explain", "--softcap", "-1"], "--softcap must be > 0 (Gemma 2 uses 50), got -1.0"),
    (["explain", "--softcap", "big"], "invalid float value"),
    (["equivalences", "--seed", "zero"], "invalid int value"),
])
def test_command_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


@pytest.mark.parametrize("command", ["demo", "explain", "equivalences"])
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "usage" in capsys.readouterr().out

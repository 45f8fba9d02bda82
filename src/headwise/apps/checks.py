"""Checks the command line makes before any work: numbers in range, paths it can write.

Each raises the house's one-line error (the value and the remedy), so a mistake costs
nothing: ``headwise explain --plot /missing/dir/x.png`` is refused before the trace runs,
not after.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path

__all__ = ["positive_float", "positive_int", "writable_file"]


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (argparse names the option in its one-line error).

    >>> positive_int("3")
    3
    """
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite number > 0.

    >>> positive_float("0.5")
    0.5
    """
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def writable_file(option: str, path: str) -> None:
    """Raise ValueError unless ``path`` can be created or overwritten as a file.

    Args:
        option: the option that named it, for the message (``--plot``).
        path: the file to be written.

    Raises:
        ValueError: the folder is missing or read-only, or ``path`` is a folder.
    """
    target = Path(path).expanduser()
    folder = target.parent
    if target.is_dir():
        raise ValueError(f"{option} {path} is a folder; give a file name inside it, e.g. {target / 'out'}")
    if not folder.is_dir():
        raise ValueError(f"{option} {path}: the folder {folder} does not exist; create it (mkdir -p {folder}) "
                         "or give another path")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{option} {path}: not writable here; give a path in a folder you can write to")

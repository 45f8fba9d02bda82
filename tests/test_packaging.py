"""What a release needs from the repository: one version, a changelog entry for it, the typed marker.

CI builds the sdist and the wheel and checks their contents (``tools/check_dist.py``); these
tests check the sources those come from.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import re
from pathlib import Path

import pytest

import headwise

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = (ROOT / "pyproject.toml").read_text()


def _table(name: str) -> str:
    """The text of one [table] of pyproject.toml (tomllib is Python 3.11+; headwise supports 3.10)."""
    match = re.search(rf"^\[{re.escape(name)}\]\n(.*?)(?=^\[|\Z)", PYPROJECT, re.M | re.S)
    assert match, f"pyproject.toml has no [{name}]"
    return match.group(1)


def test_the_version_is_written_once():
    assert re.search(r'^dynamic = \["version"\]', _table("project"), re.M)
    assert not re.search(r"^version\s*=", _table("project"), re.M)
    assert re.search(r'^version = \{ attr = "headwise.__version__" \}', _table("tool.setuptools.dynamic"), re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", headwise.__version__)
    assert importlib.metadata.version("headwise") == headwise.__version__  # what the installed metadata says


def test_the_changelog_opens_with_this_version():
    versions = re.findall(r"^## \[(\d+\.\d+\.\d+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert versions and versions[0] == headwise.__version__


def test_the_package_is_marked_typed():
    assert (ROOT / "src" / "headwise" / "py.typed").is_file()
    assert '"py.typed"' in _table("tool.setuptools.package-data")
    assert '"Typing :: Typed"' in _table("project")


def test_importing_headwise_in_a_fresh_interpreter_prints_nothing():
    """torch warns "Failed to initialize NumPy" on stderr when numpy is missing (a wheel install
    printed it twice): numpy is a dependency, and importing headwise stays silent."""
    import subprocess
    import sys

    assert re.search(r'^\s*"numpy>=[\d.]+",', _table("project"), re.M)
    run = subprocess.run([sys.executable, "-W", "default", "-c", "import headwise, headwise.cli"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0 and run.stdout == "" and run.stderr == "", run.stderr


@pytest.mark.parametrize("old", ["headwise.mask_mods", "headwise.varlen", "headwise.embed", "headwise.deprecation",
                                 "headwise.convert"])
def test_no_old_home_of_a_name_is_kept_before_a_release(old):
    """One home per name: a module that only re-exported or renamed names elsewhere is gone
    (nothing was published under it), and so is every ``__getattr__`` table of moved names."""
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)
    import headwise.dispatch
    import headwise.distributed.ring
    import headwise.kernels.chunked
    import headwise.kernels.common
    import headwise.module

    for module in (headwise.dispatch, headwise.distributed.ring, headwise.kernels.chunked, headwise.kernels.common,
                   headwise.module):
        assert "__getattr__" not in vars(module), module.__name__

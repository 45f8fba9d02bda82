"""Check the built sdist and wheel carry what headwise needs (CI runs it after ``python -m build``).

    python tools/check_dist.py dist/

Beyond ``twine check`` (which reads the metadata's rendering): the version in both file
names and in the metadata is ``headwise.__version__``; the wheel holds every module of
``src/headwise``, ``py.typed``, the C++ sources of ``csrc/`` (built on first use), the license
and the ``headwise`` command, and nothing else of the repository; its metadata has the
classifiers, URLs, license and dependencies; the sdist holds the sources, the tests, the
docs and the changelog. Prints one line per check and exits 1 when one fails.
"""

from __future__ import annotations

import ast
import sys
import tarfile
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "headwise"


def source_version() -> str:
    """``__version__`` as written in src/headwise/__init__.py (read, not imported)."""
    for node in ast.parse((PACKAGE / "__init__.py").read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__version__" for t in node.targets):
            return ast.literal_eval(node.value)
    raise SystemExit("src/headwise/__init__.py has no __version__")


def check_wheel(path: Path, version: str) -> list[str]:
    """What is wrong with the wheel at ``path`` (an empty list: nothing)."""
    problems = []
    with zipfile.ZipFile(path) as wheel:
        names = set(wheel.namelist())
        info = f"headwise-{version}.dist-info"
        metadata = Parser().parsestr(wheel.read(f"{info}/METADATA").decode())
        entry_points = wheel.read(f"{info}/entry_points.txt").decode() if f"{info}/entry_points.txt" in names else ""
    modules = {f"headwise/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.rglob("*.py")}
    problems += [f"wheel lacks {m}" for m in sorted(modules - names)]
    sources = [f"headwise/{p.relative_to(PACKAGE).as_posix()}" for p in PACKAGE.glob("csrc/*.cpp")]
    for needed in ("headwise/py.typed", f"{info}/licenses/LICENSE", *sources):
        if needed not in names:
            problems.append(f"wheel lacks {needed}")
    strays = sorted(n for n in names if not n.startswith(("headwise/", f"{info}/")))
    problems += [f"wheel carries {n}, which is not part of the package" for n in strays]
    if metadata["Version"] != version:
        problems.append(f"wheel metadata says version {metadata['Version']}, the source {version}")
    if metadata["License-Expression"] != "MIT":
        problems.append(f"wheel license is {metadata['License-Expression']!r}, not 'MIT'")
    classifiers = metadata.get_all("Classifier") or []
    for needed in ("Typing :: Typed", "Programming Language :: Python :: 3"):
        if needed not in classifiers:
            problems.append(f"wheel metadata lacks the classifier {needed!r}")
    urls = {u.split(",", 1)[0] for u in metadata.get_all("Project-URL") or []}
    problems += [f"wheel metadata lacks the {u} URL" for u in ("Documentation", "Source", "Changelog") if u not in urls]
    requires = " ".join(metadata.get_all("Requires-Dist") or [])
    needed = ("torch", "numpy", "einops", "rich", "ninja")
    problems += [f"wheel does not require {d}" for d in needed if d not in requires]
    if "headwise = headwise.cli:main" not in entry_points:
        problems.append("wheel has no headwise = headwise.cli:main console script")
    return problems


def check_sdist(path: Path, version: str) -> list[str]:
    """What is wrong with the sdist at ``path`` (an empty list: nothing)."""
    top = f"headwise-{version}/"
    with tarfile.open(path) as sdist:
        names = {n.removeprefix(top) for n in sdist.getnames()}
    needed = ["pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md", "constraints.txt", "src/headwise/py.typed",
              "src/headwise/__init__.py", "tests/conftest.py", "docs/conf.py", "docs/index.md"]
    return [f"sdist lacks {n}" for n in needed if n not in names]


def main(argv: list[str]) -> int:
    dist = Path(argv[0]) if argv else ROOT / "dist"
    version = source_version()
    wheels, sdists = sorted(dist.glob("headwise-*.whl")), sorted(dist.glob("headwise-*.tar.gz"))
    if len(wheels) != 1 or len(sdists) != 1:
        print(f"expected one wheel and one sdist in {dist}, found {[p.name for p in wheels + sdists]}")
        return 1
    problems = []
    for path in (*wheels, *sdists):
        if not path.name.startswith(f"headwise-{version}"):
            problems.append(f"{path.name} is not version {version}")
    problems += check_wheel(wheels[0], version) + check_sdist(sdists[0], version)
    for line in problems:
        print(f"FAIL {line}")
    print(f"{wheels[0].name}, {sdists[0].name}: " + ("ok" if not problems else f"{len(problems)} problems"))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

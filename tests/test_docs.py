"""The documentation site (docs/): it builds in strict mode, its reference covers every public
name, and the names its pages cite are the code's.

The site is built once for this file (about half a minute: the build runs ``headwise
explain`` for its generated pages; it times nothing, the benchmark tables are committed in
docs/_measured/).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import headwise
from conftest import markdown_blocks, run_python_block

pytest.importorskip("sphinx", reason="the docs extra is missing: pip install -e '.[docs]'")
pytest.importorskip("furo", reason="the docs extra is missing: pip install -e '.[docs]'")
pytest.importorskip("myst_parser", reason="the docs extra is missing: pip install -e '.[docs]'")

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PACKAGE = ROOT / "src" / "headwise"
NOT_DOCUMENTED = {"headwise.__main__"}  # `python -m headwise`, the command line's entry point
GUIDES = sorted(p for p in DOCS.glob("*.md") if p.name != "how-attention-works.md")


def _sources_after(built: Path) -> list[str]:
    """The sources of the site changed since ``built`` was written."""
    when = built.stat().st_mtime
    sources = [*DOCS.rglob("*.md"), *DOCS.rglob("*.py"), *PACKAGE.rglob("*.py"), ROOT / "CHANGELOG.md"]
    return [str(p) for p in sources if "_build" not in p.parts and "_generated" not in p.parts
            and p.stat().st_mtime > when]


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The site, built as CI builds it: warnings are errors.

    CI builds it just before the tests and names the result in HEADWISE_DOCS_SITE; then that
    build is checked (if no source changed after it) instead of a second, identical one.
    """
    given = os.environ.get("HEADWISE_DOCS_SITE")
    if given:
        index = Path(given) / "index.html"
        assert index.is_file(), f"HEADWISE_DOCS_SITE={given} holds no built site"
        assert _sources_after(index) == [], "HEADWISE_DOCS_SITE is older than these sources"
        return Path(given)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return _build_site(tmp_path_factory.mktemp("site"))
    # Under pytest-xdist: one build for every worker, in the session's shared temp folder (two
    # builds at once would also race on docs/_generated, which the build writes).
    from filelock import FileLock  # torch's own dependency

    shared = tmp_path_factory.getbasetemp().parent  # the session's folder, above each worker's
    with FileLock(str(shared / "site.lock")):
        out = shared / "site"
        if not (out / "index.html").is_file():
            _build_site(out)
    return out


def _build_site(out: Path) -> Path:
    command = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(DOCS), str(out)]
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, f"sphinx-build failed:\n{run.stderr[-6000:]}"
    return out


def module_names() -> list[str]:
    """Every module of the package, by its dotted name."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def public_names(module: str) -> list[str]:
    """A module's public names: its ``__all__``, or else what it defines at top level without a
    leading underscore (``logger`` aside). Read from the source, independently of the docs."""
    path = PACKAGE.parent / (module.replace(".", "/") + ".py")
    if not path.exists():
        path = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
    defined = []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Name) and target.id == "__all__":
                    return list(ast.literal_eval(node.value))
            defined += [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.append(node.target.id)
        elif isinstance(node, ast.FunctionDef | ast.ClassDef):
            defined.append(node.name)
    return [n for n in dict.fromkeys(defined) if not n.startswith("_") and n != "logger"]


def test_the_site_builds_with_every_page_and_picture(site):
    for page in [p.stem for p in GUIDES] + ["api/index", "api/headwise", "api/core", "api/kernels"]:
        assert (site / f"{page}.html").is_file(), page
    for picture in ("weights-padding.png", "weights-causal.png", "bench.png"):
        assert (site / "_images" / picture).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", picture
    bench = (site / "benchmarks.html").read_text()
    measured = json.loads((DOCS / "_measured" / "bench.json").read_text())["measured"]
    assert f"Measured on <strong>{measured['cpu']}</strong>" in bench and "headwise auto" in bench
    assert f"torch {measured['torch']}) on {measured['date']}" in bench and "not while this site was built" in bench
    attention = " ".join(re.sub(r"<[^>]+>", " ", (site / "attention.html").read_text()).split())  # the text
    assert "How multi-head attention works" in attention and "split heads q (4, 8, 10, 64)" in attention


def test_every_public_name_is_in_the_reference(site):
    html = "".join(p.read_text() for p in (site / "api").glob("*.html"))
    anchors = set(re.findall(r'id="([\w.-]+)"', html))
    missing = []
    for module in module_names():
        if module in NOT_DOCUMENTED:
            continue
        if f"module-{module}" not in anchors:
            missing.append(f"module {module}")
        mod = importlib.import_module(module)
        for name in public_names(module):
            obj = getattr(mod, name)
            # Documented where users import it: here, in the package above, or at the top level.
            homes = [module, module.rpartition(".")[0], "headwise"]
            found = f"module-{obj.__name__}" in anchors if isinstance(obj, types.ModuleType) else any(
                f"{home}.{name}" in anchors and getattr(importlib.import_module(home), name, None) is obj
                for home in homes if home)
            if not found:
                missing.append(f"{module}.{name}")
    assert missing == []


def _resolve(dotted: str) -> object:
    """The object a dotted ``headwise...`` name names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(dotted)


def test_every_headwise_name_the_pages_cite_exists():
    cited, broken = set(), []
    for page in GUIDES:
        for code in re.findall(r"`([^`\n]+)`", page.read_text()):
            cited |= {m.rstrip(".") for m in re.findall(r"\bheadwise(?:\.\w+)+", code)}
    for dotted in sorted(cited):
        try:
            _resolve(dotted)
        except (ImportError, AttributeError):
            broken.append(dotted)
    assert len(cited) > 40 and broken == []


def test_every_backend_the_pages_name_exists():
    from headwise.kernels import kernels

    known = set(kernels()) | {"auto"}
    named = {b for page in GUIDES for b in re.findall(r'backend="(\w+)"', page.read_text())}
    assert named and named - known == set()


def _table_column(page: Path, header_word: str) -> set[str]:
    """The backticked items in every table column of ``page`` whose header mentions ``header_word``."""
    items, column = set(), None
    for line in page.read_text().splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if column is None:  # the header row
            column = next((i for i, c in enumerate(cells) if header_word in c), -1)
        elif column >= 0 and not re.fullmatch(r"\|[-:| ]+\|", line.strip()):  # a row, not the rule
            items |= set(re.findall(r"`([^`]+)`", cells[column]))
    return items


def test_the_seeds_page_cites_real_stages_and_equivalence_rows():
    """Each step of the teaching documents maps to a stage that a trace really records and to a
    row group that `headwise equivalences` really measures."""
    from headwise.equivalences import measure

    stages = set()
    x, mask = torch.rand(3, 4, 32), torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    for backend in ("matmul", "sdpa"):
        mha = headwise.MultiHeadAttention(32, 4, dropout=0.1, backend=backend, packing=False)
        with headwise.trace() as t:
            mha(x, mask)
        stages |= {s.name for s in t.stages}
    seeds = DOCS / "seeds.md"
    cited_stages = _table_column(seeds, "headwise.trace()")
    assert {"scores", "scaling", "mask", "softmax", "dropout", "weighted sum", "merge heads"} <= cited_stages
    assert cited_stages - stages == set()
    cited_groups = _table_column(seeds, "headwise equivalences")
    assert len(cited_groups) >= 4 and cited_groups - {row.group for row in measure()} == set()


PAGES = sorted(p for p in DOCS.rglob("*.md") if not {"_build", "_generated"} & set(p.parts))  # the API pages too
PYTHON_BLOCKS = [(str(page.relative_to(DOCS)), line, code) for page in PAGES
                 for lang, line, code in markdown_blocks(page, "fence") if lang == "python"]


@pytest.mark.parametrize(("page", "line", "code"), PYTHON_BLOCKS,
                         ids=[f"{page}:{line}" for page, line, _ in PYTHON_BLOCKS])
def test_every_python_block_runs_alone_in_a_fresh_interpreter(page, line, code, tmp_path):
    """A reader pastes one block, not the page: each runs as ``python -c`` in a process of its own
    (``conftest.run_python_block``). Blocks that are not meant to run (signatures, output) use
    another fence (``text``, ``bash``)."""
    if re.search(r"^\s*(from|import) transformers\b", code, re.M) and not importlib.util.find_spec("transformers"):
        pytest.skip("the hf extra is not installed: pip install -e '.[hf]'")
    run = run_python_block(code, cwd=tmp_path)
    assert run.returncode == 0, f"docs/{page}:{line} failed alone:\n{run.stderr[-3000:]}"


def test_the_guides_hold_python_blocks():
    with_blocks = {page for page, _, _ in PYTHON_BLOCKS}
    assert {"index.md", "masks.md", "backends.md", "decoding.md", "serving.md", "pieces.md",
            "huggingface.md", "distributed.md", "explain.md"} <= with_blocks


def test_no_page_has_an_indented_code_block():
    """An indented block is code that no test runs and no fence names: every block is fenced."""
    indented = [f"{page.relative_to(ROOT)}:{line}" for page in [*PAGES, ROOT / "CHANGELOG.md"]
                for _, line, _ in markdown_blocks(page, "code_block")]
    assert indented == []


def layout_files() -> set[str]:
    """Paths (relative to src/headwise) that the layout tree of docs/layout.md names."""
    text = (DOCS / "layout.md").read_text()
    block = re.search(r"## Layout\n\n```text\n(.*?)```", text, re.S).group(1)
    named, folder = set(), ""
    for line in block.splitlines()[1:]:  # after "src/headwise/"
        indent = len(line) - len(line.lstrip())
        words = line.split()
        if not words:
            continue
        if indent == 2:  # a new entry: a folder ("kernels/"), a file, or files of the top level
            folder = words[0] if words[0].endswith("/") else ""
        for word in words:
            word = word.strip("(),")
            if word.endswith(".py"):
                named.add(word if "/" in word else folder + word)
    return named


def _holds_code(path: Path) -> bool:
    """False for a file that is only a docstring (a sub-package's __init__.py)."""
    body = ast.parse(path.read_text()).body
    return not (len(body) == 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant))


def test_the_layout_names_every_source_file_and_only_those():
    real = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py") if _holds_code(p)}
    named = layout_files()
    assert named - real == set(), "docs/layout.md names files that do not exist"
    assert real - named == set(), "docs/layout.md leaves these files out"


# ---------------------------------------------------------------- issue 25: published numbers, links


TIMING = ("run", "time_cases", "round_robin", "round_robin_ms", "attention_core", "decode_steps_us",
          "measure_in_child")  # headwise.bench's functions that time something


def test_a_docs_build_measures_nothing(monkeypatch, tmp_path):
    """The build renders the committed benchmark run: it runs no `headwise bench` and calls none of
    headwise.bench's timing functions (a busy build machine once published "130.79x")."""
    from headwise import bench

    monkeypatch.syspath_prepend(str(DOCS / "_ext"))
    generated = importlib.import_module("generated")
    source = ast.parse((DOCS / "_ext" / "generated.py").read_text())
    imported = {alias.name for node in ast.walk(source) if isinstance(node, ast.ImportFrom)
                and node.module == "headwise.bench" for alias in node.names}
    assert imported and not imported & set(TIMING)
    for name in TIMING:
        monkeypatch.setattr(bench, name, lambda *a, name=name, **k: pytest.fail(f"the docs build called {name}"))
    commands = []
    monkeypatch.setattr(generated, "headwise_cli", lambda *args: commands.append(args) or "")
    monkeypatch.setattr(generated, "GENERATED", tmp_path)
    generated.generate(None)
    assert commands and all("bench" not in args for args in commands)
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"
    measured = json.loads(generated.MEASURED.read_text())["measured"]
    assert set(measured) == {"cpu", "torch", "date", "command"}
    assert measured["command"].startswith("python tools/measure_docs.py")
    assert f"Measured on **{measured['cpu']}**" in (tmp_path / "bench.md").read_text()


def test_every_docs_link_on_the_source_pages_resolves(site):
    """The "[docs]" links of the highlighted source pages (sphinx.ext.viewcode) land on an anchor."""
    links, broken = 0, []
    for page in (site / "_modules").rglob("*.html"):
        for href in re.findall(r'<a class="viewcode-back" href="([^"]+)">', page.read_text()):
            links += 1
            target, _, anchor = href.partition("#")
            html = (page.parent / target).resolve()
            if not html.is_file() or f'id="{anchor}"' not in html.read_text():
                broken.append(f"{page.relative_to(site)} -> {href}")
    assert links > 100 and broken == []


def test_measure_docs_records_the_machine_torch_date_and_command(monkeypatch, tmp_path):
    """tools/measure_docs.py, the one command that writes the published tables."""
    import importlib.util

    from headwise import bench, calibration

    spec = importlib.util.spec_from_file_location("measure_docs", ROOT / "tools" / "measure_docs.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    calls = []
    monkeypatch.setattr(bench, "run", lambda **kwargs: calls.append(kwargs) or {
        "machine": {"torch": torch.__version__}, "unstable": ["core headwise sdpa S=256: median +-9%"]})
    out = tmp_path / "bench.json"
    assert tool.main(["--repeats", "3", "--out", str(out)]) == 1  # written, but a median did not settle
    assert calls[0]["quick"] and calls[0]["repeats"] == 3 and not calls[0]["memory"]
    measured = json.loads(out.read_text())["measured"]
    assert measured["cpu"] == calibration.cpu_name() and measured["torch"] == torch.__version__
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", measured["date"])
    assert measured["command"] == f"python tools/measure_docs.py --repeats 3 --out {out}"

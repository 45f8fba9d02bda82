"""headwise's native CPU kernels (``csrc/*.cpp``): built just in time on first use, or not at all.

:func:`load` compiles ``csrc/paged_attention.cpp`` with ``torch.utils.cpp_extension.load`` the
first time a kernel needs it (about a minute; torch caches the build in its extensions
directory, ``TORCH_EXTENSIONS_DIR``, and a file lock there lets concurrent processes build it
once). The build targets this CPU (``-march=native``), so the extension's name carries a tag
of the CPU, the torch version, the flags and the source's text: a cache directory shared
between machines never serves another CPU's build.

torch reruns a build whose command changed, and the command names the source's path and the
include paths of the torch that builds it. So the source is built from a copy in the build's
own directory, and once a build has loaded, a stamp beside it lets every later load import it
directly, without asking torch (and ninja) whether the command changed: a checkout and a wheel,
or two virtual environments with the same torch (its version and git revision are in the tag),
share one build. Before, loading in turn from two installs or two environments rebuilt it every
time (about 40 s on 2 cores; CI built it three times a run, then twice).

Where it cannot be built (no compiler, ``HEADWISE_NO_EXTENSION=1``, any build error),
:func:`load` returns None, :func:`unavailable` says why, and the callers run their
pure-PyTorch path; a warning says so once per process.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import shutil
import warnings
from pathlib import Path
from types import ModuleType

import torch

__all__ = ["load", "loaded", "load_state", "unavailable", "DISABLE_VARIABLE"]

logger = logging.getLogger(__name__)

DISABLE_VARIABLE = "HEADWISE_NO_EXTENSION"  # set to 1: never build, always the pure-PyTorch paths
SOURCE = Path(__file__).with_name("csrc") / "paged_attention.cpp"
# No -ffast-math: the kernel's bits must not depend on how the compiler vectorises (issue 37);
# no FMA contraction, so a vectorised lane and a scalar one round alike.
# -fopenmp: at::parallel_for is OpenMP in torch's Linux builds, compiled into the caller (without
# it, one thread); the extension then shares torch's libgomp, so torch.set_num_threads holds.
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
LDFLAGS = ["-fopenmp"]

_state: dict[str, object] = {}  # "module": the loaded extension, or "why": why the build failed
_warned: set[str] = set()


def _build_tag() -> str:
    """A short hash of what a -march=native build depends on: the CPU, torch (its version and the
    git revision it was built from: its ABI, not where it is installed), the flags and the
    source's text."""
    cpu = platform.machine() + platform.processor()
    try:
        with open("/proc/cpuinfo") as info:
            cpu += "".join(line for line in info if line.startswith(("model name", "flags")))[:8192]
    except OSError:
        pass
    revision = str(getattr(torch.version, "git_version", ""))
    text = "|".join([cpu, torch.__version__, revision, " ".join(FLAGS + LDFLAGS), SOURCE.read_text()])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH; the ninja package (a dependency) puts it in the
    environment's bin, which is not on PATH where the environment was not activated."""
    if shutil.which("ninja") is not None:
        return
    try:
        ninja = importlib.import_module("ninja")
    except ImportError:
        return  # torch's build then says that ninja is missing: the fallback's reason
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build() -> ModuleType:
    from torch.utils import cpp_extension  # imported on first use: it is slow to import

    _ninja_on_path()

    name = f"headwise_paged_{_build_tag()}"
    build_directory = Path(cpp_extension._get_build_directory(name, verbose=False))
    built = _import_built(name, build_directory)
    if built is not None:
        return built
    logger.info("loading headwise's native paged kernel %s (built once per CPU and torch, about a minute)", name)
    source = _staged(build_directory)
    with warnings.catch_warnings():  # torch warns about the compiler's ABI; the build either works or raises
        warnings.simplefilter("ignore")
        module = cpp_extension.load(name=name, sources=[str(source)], extra_cflags=FLAGS, extra_ldflags=LDFLAGS,
                                    verbose=False)
    _write_atomically(build_directory / STAMP, Path(module.__file__).name.encode())
    return module


STAMP = "loaded"  # in a build's directory: the file name of a library that torch built there and a process loaded


def _import_built(name: str, build_directory: Path) -> ModuleType | None:
    """The library built in ``build_directory`` where its stamp says a process loaded it (so it is
    whole: the stamp is written after the load, and atomically), imported without torch's build
    step; None where there is none yet, or it does not import (then torch's build decides)."""
    try:
        library = build_directory / (build_directory / STAMP).read_text()
    except OSError:
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None or not library.is_file():
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as error:
        logger.info("the built %s did not import (%s); building it again", library, error)
        return None
    return module


def _write_atomically(path: Path, data: bytes) -> None:
    """``path`` holding ``data``, written through a temporary file, so a process beside this one
    reads the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    partial.write_bytes(data)
    os.replace(partial, path)


def _staged(build_directory: Path) -> Path:
    """The copy of :data:`SOURCE` in ``build_directory`` that the build compiles: written where
    it is missing or differs (atomically, so a process building beside this one reads a whole
    file), left as it is otherwise, so that its path and its time stamp, which ninja compares,
    stay the same for every install of this source."""
    staged = build_directory / SOURCE.name
    text = SOURCE.read_bytes()
    if not staged.is_file() or staged.read_bytes() != text:
        _write_atomically(staged, text)
    return staged


def load() -> ModuleType | None:
    """The compiled extension, built on the first call (None where it cannot be: see :func:`unavailable`)."""
    why = unavailable()
    if why is None:
        if "module" in _state:
            return _state["module"]  # type: ignore[return-value]
        try:
            _state["module"] = _build()
            return _state["module"]  # type: ignore[return-value]
        except Exception as error:  # no compiler, no ninja, a compile error: the PyTorch path serves
            why = _state["why"] = f"building {SOURCE.name} failed ({type(error).__name__}: {str(error).strip()[-300:]})"
    if why not in _warned:  # once per reason and process
        _warned.add(why)
        logger.warning("headwise's native paged kernel is not available: %s; the pure-PyTorch path serves", why)
        warnings.warn(f"headwise's native paged kernel is not available: {why}; paged attention runs its slower "
                      "pure-PyTorch path", RuntimeWarning, stacklevel=3)
    return None


def loaded() -> ModuleType | None:
    """The extension if it is built and allowed; never builds, never warns."""
    return _state.get("module") if unavailable() is None else None  # type: ignore[return-value]


def unavailable() -> str | None:
    """Why the extension cannot serve (None: it is built, or not tried yet and allowed)."""
    if os.environ.get(DISABLE_VARIABLE, "") not in ("", "0"):
        return f"{DISABLE_VARIABLE}={os.environ[DISABLE_VARIABLE]} is set"
    why = _state.get("why")
    return None if why is None else str(why)


def load_state() -> str:
    """``"built"``, ``"unavailable"`` or ``"not tried"``: what :func:`load` has done so far."""
    if unavailable() is not None:
        return "unavailable"
    return "built" if "module" in _state else "not tried"

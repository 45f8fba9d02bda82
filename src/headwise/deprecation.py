"""Renamed public names keep working: they warn once per process, then behave as before."""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["warn_once", "moved"]

_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> None:
    """A ``FutureWarning`` with ``message``, the first time ``key`` is seen in this process."""
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(message, FutureWarning, stacklevel=stacklevel)


def moved(module: str, names: dict[str, tuple[Any, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` (PEP 562) for attributes that moved elsewhere.

    Args:
        module: the old module's name, for the message.
        names: old attribute name -> (the object or module name that holds it now, its new
            dotted name); the value is read from the new place at every access, so it follows
            changes there (a module named by string is imported on first access).

    >>> import types
    >>> ns = types.SimpleNamespace(LIMIT=3)
    >>> get = moved("old.place", {"LIMIT": (ns, "new.place.LIMIT")})
    >>> import warnings
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("ignore")
    ...     get("LIMIT")
    3
    """
    def __getattr__(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        owner, new = names[name]
        warn_once(f"{module}.{name}", f"{module}.{name} moved to {new}; the old name will be removed")
        if isinstance(owner, str):
            owner = importlib.import_module(owner)
        return getattr(owner, new.rsplit(".", 1)[1])

    return __getattr__

"""The one switch between the native (C++) hot paths and their Python twins.

It says *whether* the native path is on and hands out the extension; it knows no
room. Each room picks its own twin (``twin()``, or ``extension()`` where a room
marshals arguments first; the front-end imports its Cython step loop itself), so
this module sits on the bottom floor and imports nothing of the package but ``_C``.

``ENGINECORE_NATIVE=0`` in the environment, or ``set_native(False)`` (which the
``use_native`` config flag calls), forces every hot path onto pure Python.
Results are identical either way; only speed differs.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

try:  # the extension is optional at import time so a broken build degrades, loudly
    from enginecore import _C as _ext  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - exercised only without a build
    _ext = None
    _import_error: ImportError | None = e
else:
    _import_error = None


def _env_allows_native() -> bool:
    value = os.environ.get("ENGINECORE_NATIVE", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


_enabled: bool = _env_allows_native()


def extension() -> ModuleType | None:
    """The loaded extension module when the native path is in use, else None."""
    return _ext if (_enabled and _ext is not None) else None


def native_available() -> bool:
    """True when the native hot paths are built and switched on."""
    return extension() is not None


def twin(name: str, python: T) -> T:
    """``_C.name`` when the native path is on, else its Python twin ``python`` (by the
    twin rule, ``name_py``): how a room picks its twin without this module knowing
    the room. Ask at call time or when an object is made, not at import, so the
    switch moves every hot path at once."""
    ext = extension()
    return python if ext is None else getattr(ext, name)


def version_py() -> str:
    """The twin of ``_C.version``: the version of the installed enginecore."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("enginecore")
    except PackageNotFoundError:  # a source tree on sys.path, never installed
        return "0+unknown"


def set_native(enabled: bool | None) -> None:
    """Switch the hot paths; ``None`` keeps the environment's choice.

    Asking for the native path without a build is an error, not a silent
    fallback, so a benchmark never measures the wrong thing.
    """
    global _enabled
    if enabled is None:
        return
    if enabled and _ext is None:
        raise RuntimeError(f"enginecore native extension is not available: {_import_error}")
    _enabled = bool(enabled)


if _env_allows_native() and _ext is None:
    logger.warning("enginecore._C could not be imported (%s); using pure Python", _import_error)

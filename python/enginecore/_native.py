"""The one switch between the native (C++) hot paths and their Python twins.

``ENGINECORE_NATIVE=0`` in the environment, or ``set_native(False)`` (which the
``use_native`` config flag calls), forces every hot path onto pure Python.
Results are identical either way; only speed differs.
"""

from __future__ import annotations

import logging
import os
from types import ModuleType

logger = logging.getLogger(__name__)

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


_step_loop_cy: ModuleType | None = None


def step_loop() -> ModuleType:
    """The front-end output processor's per-step loop: the Cython module
    (``frontend/step_loop_cy.pyx``, built by the same CMake build as ``_C``) on the
    native path, its Python twin ``frontend/step_loop.py`` otherwise. Imported on
    first use (the front-end is not loaded with the package)."""
    global _step_loop_cy
    if extension() is None:
        from enginecore.frontend import step_loop

        return step_loop
    if _step_loop_cy is None:
        try:
            from enginecore.frontend import step_loop_cy
        except ImportError as e:  # the same build makes both: a broken install
            raise RuntimeError(f"enginecore._C is built but the Cython step loop is not: {e}; "
                               "reinstall, or run with ENGINECORE_NATIVE=0") from e
        _step_loop_cy = step_loop_cy
    return _step_loop_cy


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

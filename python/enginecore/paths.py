"""Where enginecore keeps files of its own (fetched and converted models, CURVE keys)."""

from __future__ import annotations

import os


def default_cache_dir() -> str:
    """Where enginecore keeps fetched and converted models (``ENGINECORE_CACHE_DIR``)."""
    return os.environ.get(
        "ENGINECORE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "enginecore")
    )

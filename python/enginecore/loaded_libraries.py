"""Which shared libraries this process has mapped (the Python twin of
csrc/loaded_library.cpp's search, for the twins of ``_C.libzmq_path`` and
``_C.cpu_kernels_info``)."""

from __future__ import annotations

from pathlib import Path


def loaded_library_path(name_part: str) -> str | None:
    """The path of the first mapped library whose file name contains ``name_part``
    (Linux's /proc/self/maps), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and name_part in Path(fields[5]).name:
            return fields[5]
    return None

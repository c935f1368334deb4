"""The CPU's feature flags as Linux lists them in /proc/cpuinfo (it lists only what
the OS enabled): what the weight packing, the dtype default and the kernels' Python
twin read, parsed once."""

from __future__ import annotations

import functools


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The first processor's ``flags`` line as a set (empty where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()

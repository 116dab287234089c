"""The host (CPU) memory the process can still take: what Strata sizes its own allocations by (the KV
cache, prepacked weight copies), after the weights are loaded."""

from __future__ import annotations

import os


def available_bytes() -> int:
    """Memory that can be allocated without swapping: the kernel's MemAvailable where there is one."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def total_bytes() -> int:
    """The machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

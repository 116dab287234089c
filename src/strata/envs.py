"""Every environment variable Strata reads, in one place, with its default.

Engine code receives values through config objects; only config defaults come from here.
"""

from __future__ import annotations

import os


def _get_int(name: str, default: int | None) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from exc


def kv_cache_memory_default() -> int | None:
    """STRATA_KV_CACHE_MEMORY: bytes for the KV cache; unset = derived from free memory."""
    return _get_int("STRATA_KV_CACHE_MEMORY", None)


def num_threads_default() -> int | None:
    """STRATA_NUM_THREADS: torch intra-op threads; unset = leave torch's choice."""
    return _get_int("STRATA_NUM_THREADS", None)

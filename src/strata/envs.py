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


def _get_bool(name: str, default: bool) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"environment variable {name} must be 1/true or 0/false, got {raw!r}")


def use_hw_agnostic_default() -> bool:
    """STRATA_USE_HW_AGNOSTIC: default of `layer_impl` when neither the API nor the CLI gives one."""
    return _get_bool("STRATA_USE_HW_AGNOSTIC", False)


def prepack_weights_default() -> bool:
    """STRATA_PREPACK_WEIGHTS: keep a second, GEMM-ready copy of CPU linear weights for prefill and batches
    (faster there, at the cost of a second copy of the linear weights' memory); on by default."""
    return _get_bool("STRATA_PREPACK_WEIGHTS", True)


def plugins_default() -> list[str] | None:
    """STRATA_PLUGINS: comma-separated plugin names to load; unset = every installed plugin, empty = none."""
    raw = os.environ.get("STRATA_PLUGINS")
    if raw is None:
        return None
    return [name.strip() for name in raw.split(",") if name.strip()]


def plugins_strict_default() -> bool:
    """STRATA_PLUGINS_STRICT: a plugin that fails to load is an error (1, default) or a warning and a skip (0)."""
    return _get_bool("STRATA_PLUGINS_STRICT", True)


def use_layer_name_default() -> bool:
    """STRATA_USE_LAYERNAME: pass layer names to ops as `LayerName` (on; off where torch lacks opaque types)."""
    return _get_bool("STRATA_USE_LAYERNAME", True)


def compile_default() -> bool:
    """STRATA_COMPILE: default of `compile` (off until compiled decode is faster everywhere)."""
    return _get_bool("STRATA_COMPILE", False)


def cache_root() -> str:
    """STRATA_CACHE_ROOT: where Strata keeps caches; default ~/.cache/strata."""
    return os.environ.get("STRATA_CACHE_ROOT") or os.path.join(os.path.expanduser("~"), ".cache", "strata")


def disable_compile_cache() -> bool:
    """STRATA_DISABLE_COMPILE_CACHE=1: compile from scratch every start and write nothing to disk."""
    return _get_bool("STRATA_DISABLE_COMPILE_CACHE", False)


def disable_cpu_kernels() -> bool:
    """STRATA_DISABLE_CPU_KERNELS=1: never build or use Strata's C++ CPU kernels (ATen everywhere)."""
    return _get_bool("STRATA_DISABLE_CPU_KERNELS", False)


def adaptive_threads_default() -> bool:
    """STRATA_ADAPTIVE_THREADS: let the engine lower (and raise again) its CPU thread count when measured
    steps show that fewer threads are faster, as when another process takes a core (on)."""
    return _get_bool("STRATA_ADAPTIVE_THREADS", True)


def cpu_kernel_target() -> str:
    """STRATA_CPU_KERNEL_TARGET: the CPU Strata's C++ kernels are compiled for (`-march`/`-mcpu`); default
    `native`, this machine. Another value (`x86-64-v3`: AVX2 without AVX-512) builds them for older CPUs of
    the family, as a cache shared between machines needs, or to test their paths here."""
    return os.environ.get("STRATA_CPU_KERNEL_TARGET") or "native"


def _get_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise ValueError(f"environment variable {name} must be a number of seconds, got {raw!r}") from exc
    if value <= 0:
        raise ValueError(f"environment variable {name} must be positive, got {raw!r}")
    return value


def process_start_timeout() -> float:
    """STRATA_PROCESS_START_TIMEOUT: seconds a spawned rank or replica may take to build its model."""
    return _get_seconds("STRATA_PROCESS_START_TIMEOUT", 600.0)


def heartbeat_timeout() -> float:
    """STRATA_HEARTBEAT_TIMEOUT: seconds a starting rank or replica may send no heartbeat before it counts as
    hung (suspended, deadlocked); its first heartbeat, after it imported the parent's script, may take 4x."""
    return _get_seconds("STRATA_HEARTBEAT_TIMEOUT", 30.0)

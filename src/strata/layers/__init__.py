"""Strata's default layers: the fastest implementation of each op per platform."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType


@functools.cache
def load_triton_kernels() -> ModuleType | None:
    """`strata.layers.triton_kernels` for the CUDA paths, or None where Triton is not installed."""
    try:
        return importlib.import_module("strata.layers.triton_kernels")
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        return None

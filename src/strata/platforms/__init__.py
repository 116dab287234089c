"""The platform Strata runs on: it decides which `forward_<platform>` method an enabled CustomOp uses.

`current_platform` is CUDA when torch sees a GPU, else CPU; a plugin may install its own platform with
`set_current_platform(Platform("chip", forward_method="forward_oot"))` from its `register()`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Platform:
    """A device family; `forward_method` is the CustomOp method its enabled ops call."""

    name: str
    forward_method: str


CPU = Platform(name="cpu", forward_method="forward_cpu")
CUDA = Platform(name="cuda", forward_method="forward_cuda")


def detect_platform() -> Platform:
    return CUDA if torch.cuda.is_available() else CPU


current_platform: Platform = detect_platform()


def set_current_platform(platform: Platform) -> None:
    """Install an out-of-tree platform (from a plugin's `register()`); layers built afterwards use it."""
    global current_platform
    if not isinstance(platform, Platform):
        raise TypeError(f"platform must be a strata.platforms.Platform, got {type(platform).__name__}")
    current_platform = platform

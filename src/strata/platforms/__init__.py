"""The platforms Strata runs on, by name: the CPU and CUDA in tree, more from plugins.

`get_platform(device)` is how the engine finds the platform for a device string ("cpu", "cuda:1", or a
plugin's name); a plugin adds its own with `register_platform` from its `register()`. See `interface.py`
for what a platform provides and `cpu/`, `cuda/` for the two in tree.
"""

from __future__ import annotations

from strata.platforms.interface import Platform, ThreadPolicy

__all__ = ["Platform", "PlatformError", "ThreadPolicy", "get_platform", "platform_names", "register_platform"]


class PlatformError(ValueError):
    """A device names no registered platform, or a platform is registered twice or malformed."""


_platforms: dict[str, Platform] = {}


def register_platform(platform: Platform) -> None:
    """Make `platform` available under its name (`LLM(device=platform.name)`)."""
    if not isinstance(platform, Platform):
        raise PlatformError(
            f"register_platform needs a strata.platforms.Platform, got {type(platform).__name__}"
        )
    for attribute in ("name", "device_type", "forward_method"):
        if not isinstance(getattr(platform, attribute, None), str):
            raise PlatformError(
                f"platform {type(platform).__qualname__} must set the class attribute {attribute}"
            )
    if ":" in platform.name:
        raise PlatformError(f"platform name {platform.name!r} must not contain ':'")
    previous = _platforms.get(platform.name)
    if previous is not None and type(previous) is not type(platform):
        raise PlatformError(
            f"platform {platform.name!r} is registered twice: {type(previous).__qualname__} and "
            f"{type(platform).__qualname__}"
        )
    _platforms[platform.name] = platform


def _register_in_tree() -> None:
    if "cpu" not in _platforms:
        from strata.platforms.cpu import CpuPlatform
        from strata.platforms.cuda import CudaPlatform

        register_platform(CpuPlatform())
        register_platform(CudaPlatform())


def platform_names() -> list[str]:
    """The names of the registered platforms (load plugins first to include theirs)."""
    _register_in_tree()
    return sorted(_platforms)


def get_platform(device: str) -> Platform:
    """The platform a device string names: its part before any ':' ("cuda" for "cuda:1")."""
    _register_in_tree()
    if not isinstance(device, str):
        raise PlatformError(f"device must be a string such as 'cpu', got {type(device).__name__}")
    platform = _platforms.get(device.partition(":")[0])
    if platform is None:
        raise PlatformError(f"device {device!r} names no platform; known: {', '.join(sorted(_platforms))}")
    return platform

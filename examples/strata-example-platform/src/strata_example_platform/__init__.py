"""Example Strata platform plugin: the device "example", computing on the CPU, with its own attention backend
and its own RMSNorm; every other op runs its hw-agnostic reference."""

from __future__ import annotations

import os

import torch

from strata.platforms import Platform, register_platform


class ExamplePlatform(Platform):
    name = "example"
    device_type = "cpu"
    forward_method = "forward_example"
    layer_modules = ("strata_example_platform.layers",)
    attention_backend_class = "strata_example_platform.attention.ExampleAttentionBackend"

    def available_memory(self, device: torch.device) -> int:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def register() -> None:
    """Entry point of group `strata.plugins`; Strata calls it once per process before it resolves a device."""
    register_platform(ExamplePlatform())

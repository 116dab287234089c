"""The resolver, the one place a layer's class and forward method are decided: a plugin's override, else the
reference when the layer config asks for it, else the platform's first implementation that supports the
layer, else the reference; per op, with a log line saying which and why."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from strata.config import LayerConfig
from strata.custom_op import CustomOp, op_registry, register_implementation
from strata.hw_agnostic.layers import RMSNorm, SiluAndMul
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm
from strata.models.transformers.layers import LayerResolver
from strata.platforms import Platform, PlatformError, get_platform, register_platform

DEFAULT = LayerConfig(layer_impl="default")
HW = LayerConfig(layer_impl="hw-agnostic")


class ChipPlatform(Platform):
    name = "chip"
    device_type = "cpu"
    forward_method = "forward_chip"


@pytest.fixture(autouse=True)
def chip(restore_registry: None) -> Platform:
    """A platform of the test's own, with implementations registered only while the test runs."""
    register_platform(ChipPlatform())
    for implementation in (SmallChipNorm, AnyChipNorm, NoMethodSilu):
        register_implementation("chip")(implementation)
    return get_platform("chip")


class SmallChipNorm(RMSNorm):
    """Serves only norms of up to 64 channels."""

    @classmethod
    def supports(cls, hidden_size: int, *args: Any, **kwargs: Any) -> str | None:
        return None if hidden_size <= 64 else f"{hidden_size} channels are more than 64"

    def forward_chip(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class AnyChipNorm(RMSNorm):
    def forward_chip(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        return self.forward_native(x, residual)


class NoMethodSilu(SiluAndMul):
    """Registered for the chip but without its `forward_chip`: never picked."""


def test_the_platforms_first_supporting_implementation_serves(chip: Platform) -> None:
    resolver = LayerResolver(DEFAULT, chip)
    small, large = resolver.build("rms_norm", 32), resolver.build("rms_norm", 128)
    assert (type(small), small.forward_method_name) == (SmallChipNorm, "forward_chip")
    assert (type(large), large.forward_method_name) == (AnyChipNorm, "forward_chip")
    assert small.provider == "chip" and small.init_args == ((32,), {})
    silu = resolver.build("silu_and_mul")
    assert (type(silu), silu.forward_method_name) == (SiluAndMul, "forward_native")
    gemma = resolver.build("gemma_rms_norm", 32)  # no chip implementation: the reference, on its own
    assert type(gemma) is GemmaRMSNorm and gemma.provider == "hw-agnostic"


def test_why_an_implementation_declined_is_logged_once(
    chip: Platform, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata.layers")
    op_registry["rms_norm"].implementations["chip"].remove(AnyChipNorm)
    resolver = LayerResolver(DEFAULT, chip)
    for _ in range(2):
        assert type(resolver.build("rms_norm", 128)) is RMSNorm
    resolver.build("silu_and_mul")
    assert caplog.messages == [
        "layer rms_norm: RMSNorm.forward_native (SmallChipNorm: 128 channels are more than 64)",
        "layer silu_and_mul: SiluAndMul.forward_native (NoMethodSilu: has no forward_chip)",
    ]


@pytest.mark.parametrize(
    ("layer_config", "method"),
    [
        (HW, "forward_native"),
        (LayerConfig(custom_ops=["none"]), "forward_native"),
        (LayerConfig(custom_ops=["none", "+rms_norm"]), "forward_chip"),
        (LayerConfig(custom_ops=["all", "-rms_norm"]), "forward_native"),
    ],
)
def test_the_layer_config_can_keep_the_reference(
    chip: Platform, layer_config: LayerConfig, method: str
) -> None:
    norm = LayerResolver(layer_config, chip).build("rms_norm", 32)
    assert norm.forward_method_name == method
    assert type(norm) is (RMSNorm if method == "forward_native" else SmallChipNorm)


def test_an_override_wins_everywhere_and_runs_forward_oot_where_enabled(chip: Platform) -> None:
    class Kernel(RMSNorm):
        def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
            return x

    CustomOp.register_oot(Kernel, name="RMSNorm")
    for layer_config in (DEFAULT, HW):
        for platform in (chip, get_platform("cpu")):
            norm = LayerResolver(layer_config, platform).build("rms_norm", 24, 1e-3, dtype=torch.float64)
            assert (type(norm), norm.forward_method_name) == (Kernel, "forward_oot")
            assert norm.weight.dtype == torch.float64 and norm.variance_epsilon == 1e-3  # its arguments
    disabled = LayerResolver(LayerConfig(custom_ops=["none"]), chip).build("rms_norm", 8)
    assert (type(disabled), disabled.forward_method_name) == (Kernel, "forward_native")


def test_platforms_are_found_by_device_and_registered_once() -> None:
    assert get_platform("cpu").name == "cpu" and get_platform("cuda:1").name == "cuda"
    with pytest.raises(PlatformError, match=r"'tpu' names no platform; known: chip, cpu, cuda"):
        get_platform("tpu")

    class OtherChip(ChipPlatform):
        pass

    with pytest.raises(PlatformError, match="registered twice"):
        register_platform(OtherChip())
    with pytest.raises(PlatformError, match=r"strata\.platforms\.Platform"):
        register_platform("cuda")  # type: ignore[arg-type]

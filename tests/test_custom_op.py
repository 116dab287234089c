"""The CustomOp registry: one registry for in-tree and out-of-tree classes, construction-time swaps,
duplicate names, and forward-method dispatch from the platform and the `custom_ops` setting."""

from __future__ import annotations

import copy
from collections.abc import Iterator

import pytest
import torch

from strata import platforms
from strata.config import ConfigError, LayerConfig, get_current_layer_config, set_current_layer_config
from strata.custom_op import (
    CustomOp,
    RegistrationError,
    maybe_get_oot_by_class,
    op_registry,
)
from strata.hw_agnostic.layers import layernorm as hw_layernorm
from strata.layers import activation, layernorm


@pytest.fixture(autouse=True)
def restore_registry() -> Iterator[None]:
    """Overrides registered here must not reach other tests' models."""
    saved = {name: copy.copy(entry) for name, entry in op_registry.items()}
    for entry in saved.values():
        entry.in_tree = dict(entry.in_tree)
    yield
    op_registry.clear()
    op_registry.update(saved)


def test_override_applies_to_both_providers_and_takes_the_same_arguments() -> None:
    @layernorm.RMSNorm.register_oot
    class MyNorm(hw_layernorm.RMSNorm):
        pass

    for cls in (layernorm.RMSNorm, hw_layernorm.RMSNorm):
        norm = cls(24, 1e-3, dtype=torch.float64)
        assert type(norm) is MyNorm
        assert norm.weight.shape == (24,) and norm.weight.dtype == torch.float64
        assert norm.variance_epsilon == 1e-3
    assert maybe_get_oot_by_class(layernorm.RMSNorm) is MyNorm
    assert maybe_get_oot_by_class(layernorm.GemmaRMSNorm) is layernorm.GemmaRMSNorm
    assert MyNorm.provider == f"oot:{__name__}.{MyNorm.__qualname__}"
    assert MyNorm.op_name == "rms_norm"


def test_override_registered_before_the_class_exists_applies() -> None:
    class Override(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    CustomOp.register_oot(Override, name="LateOp")

    @CustomOp.register("late_op")
    class LateOp(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x

    op = LateOp()
    assert type(op) is Override
    assert Override.op_name == "late_op"  # learnt from the in-tree class registered afterwards
    assert op(torch.zeros(1)).item() == 1


def test_register_oot_forms() -> None:
    @CustomOp.register_oot(name="SiluAndMul")
    class A(activation.SiluAndMul):
        pass

    assert type(activation.SiluAndMul()) is A

    @activation.GeluAndMul.register_oot()
    class B(activation.GeluAndMul):
        pass

    assert type(activation.GeluAndMul(approximate="tanh")) is B
    assert activation.GeluAndMul(approximate="tanh").approximate == "tanh"
    with pytest.raises(RegistrationError, match="name="):
        CustomOp.register_oot(A)


def test_duplicate_names_fail_naming_both_classes() -> None:
    class First(layernorm.RMSNorm):
        pass

    class Second(layernorm.RMSNorm):
        pass

    CustomOp.register_oot(First, name="RMSNorm")
    with pytest.raises(RegistrationError, match=r"First.*Second"):
        CustomOp.register_oot(Second, name="RMSNorm")

    with pytest.raises(RegistrationError, match=r"layernorm\.RMSNorm.*Again"):

        @CustomOp.register("rms_norm")
        class RMSNorm(CustomOp):  # same class name, op name and provider as strata.layers.layernorm's
            __qualname__ = "Again"

    with pytest.raises(RegistrationError, match="already used by RMSNorm"):

        @CustomOp.register("rms_norm")
        class OtherNorm(CustomOp):
            pass


@pytest.mark.parametrize(
    ("custom_ops", "rms", "silu"),
    [
        (["all"], "forward_cpu", "forward_cpu"),
        (["none"], "forward_native", "forward_native"),
        (["none", "+rms_norm"], "forward_cpu", "forward_native"),
        (["all", "-silu_and_mul"], "forward_cpu", "forward_native"),
    ],
)
def test_custom_ops_selects_the_forward_method(custom_ops: list[str], rms: str, silu: str) -> None:
    with set_current_layer_config(LayerConfig(layer_impl="default", custom_ops=custom_ops)):
        norm, act = layernorm.RMSNorm(8), activation.SiluAndMul()
    assert (norm.forward_method_name, act.forward_method_name) == (rms, silu)
    assert norm._forward_method == getattr(norm, rms)


def test_platform_and_overrides_pick_their_methods(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platforms, "current_platform", platforms.CUDA)
    assert layernorm.RMSNorm(8).forward_method_name == "forward_cuda"
    # The hw-agnostic class has no fast path: it reports the forward_native it really runs.
    assert hw_layernorm.RMSNorm(8).forward_method_name == "forward_native"
    chip = platforms.Platform(name="chip", forward_method="forward_oot")
    platforms.set_current_platform(chip)
    assert platforms.current_platform is chip
    assert layernorm.RMSNorm(8).forward_method_name == "forward_native"

    class Kernel(layernorm.RMSNorm):
        def forward_oot(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
            return x

    CustomOp.register_oot(Kernel, name="RMSNorm")
    assert layernorm.RMSNorm(8).forward_method_name == "forward_oot"
    with set_current_layer_config(LayerConfig(custom_ops=["none"])):
        assert layernorm.RMSNorm(8).forward_method_name == "forward_native"
    with pytest.raises(TypeError, match="Platform"):
        platforms.set_current_platform("cuda")  # type: ignore[arg-type]


def test_layer_config_validation_and_env_default(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="layer_impl"):
        LayerConfig(layer_impl="fast")
    for bad in ("all", ["all", "none"], ["rms_norm"], ["+"]):
        with pytest.raises(ConfigError, match="custom_ops"):
            LayerConfig(custom_ops=bad)  # type: ignore[arg-type]
    monkeypatch.setenv("STRATA_USE_HW_AGNOSTIC", "1")
    assert LayerConfig().layer_impl == "hw-agnostic"
    assert LayerConfig(layer_impl="default").layer_impl == "default"  # the option beats the env default
    monkeypatch.setenv("STRATA_USE_HW_AGNOSTIC", "maybe")
    with pytest.raises(ValueError, match="STRATA_USE_HW_AGNOSTIC"):
        LayerConfig()


def test_current_layer_config_is_scoped_to_the_block() -> None:
    outer, inner = LayerConfig(layer_impl="hw-agnostic"), LayerConfig(layer_impl="default")
    with set_current_layer_config(outer):
        with set_current_layer_config(inner):
            assert get_current_layer_config() is inner
        assert get_current_layer_config() is outer
    outside = get_current_layer_config()
    assert outside is not outer and outside is not inner

"""The registry: one class defines each op, platforms add implementations, plugins add overrides; names are
unique, and each registration says clearly what is wrong with it. Which of them a layer gets is the
resolver's (tests/models/test_layer_resolver.py)."""

from __future__ import annotations

import pytest
import torch

from strata.config import ConfigError, LayerConfig, get_current_layer_config, set_current_layer_config
from strata.custom_op import (
    CustomOp,
    RegistrationError,
    construct,
    describe_layers,
    op_registry,
    reference_of,
    register_implementation,
    register_oot,
)
from strata.hw_agnostic.layers import GeluAndMul, GluMLP, RMSNorm, SiluAndMul
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm

pytestmark = pytest.mark.usefixtures("restore_registry")


def test_each_op_is_defined_by_its_reference_class() -> None:
    assert op_registry["rms_norm"].reference is RMSNorm
    assert op_registry["gemma_rms_norm"].reference is GemmaRMSNorm
    assert op_registry["glu_mlp"].reference is GluMLP
    assert RMSNorm.op_name == "rms_norm" and RMSNorm.provider == "hw-agnostic"
    norm = RMSNorm(8)  # constructed directly: that very class, running its reference
    assert type(norm) is RMSNorm and norm.forward_method_name == "forward_native"


def test_an_implementation_joins_its_ops_entry_under_its_platform_in_order() -> None:
    @register_implementation("chip")
    class First(GemmaRMSNorm):
        pass

    @register_implementation("chip")
    class Second(GemmaRMSNorm):
        pass

    assert op_registry["gemma_rms_norm"].implementations["chip"] == [First, Second]
    assert First.provider == "chip" and First.op_name == "gemma_rms_norm"
    # Gemma's norm subclasses Llama's, but is an op of its own: its implementations are not Llama's.
    assert First not in op_registry["rms_norm"].implementations.get("chip", [])
    with pytest.raises(RegistrationError, match="subclasses no registered op class"):
        register_implementation("chip")(type("Loose", (CustomOp,), {}))


def test_an_override_may_be_registered_before_its_op_exists() -> None:
    class Override(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x + 1

    CustomOp.register_oot(Override, name="LateOp")

    @CustomOp.register("late_op")
    class LateOp(CustomOp):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return x

    assert op_registry["late_op"].oot is Override
    assert Override.provider == f"oot:{__name__}.{Override.__qualname__}"


def test_register_oot_forms() -> None:
    @CustomOp.register_oot(name="SiluAndMul")
    class A(SiluAndMul):
        pass

    assert op_registry["silu_and_mul"].oot is A

    @GeluAndMul.register_oot()
    class B(GeluAndMul):
        pass

    assert op_registry["gelu_and_mul"].oot is B

    @RMSNorm.register_oot
    class C(RMSNorm):
        pass

    assert op_registry["rms_norm"].oot is C
    with pytest.raises(RegistrationError, match="name="):
        CustomOp.register_oot(A)
    with pytest.raises(RegistrationError, match="needs a CustomOp"):
        register_oot(len, "RMSNorm")  # type: ignore[arg-type]


def test_duplicate_names_fail_naming_both_classes() -> None:
    class First(RMSNorm):
        pass

    class Second(RMSNorm):
        pass

    CustomOp.register_oot(First, name="RMSNorm")
    with pytest.raises(RegistrationError, match=r"First.*Second"):
        CustomOp.register_oot(Second, name="RMSNorm")

    with pytest.raises(RegistrationError, match=r"layernorm\.RMSNorm.*Again"):

        @CustomOp.register("rms_norm")
        class Again(CustomOp):
            pass

    with pytest.raises(RegistrationError, match="already the name of op 'rms_norm'"):
        CustomOp.register("other_norm")(type("RMSNorm", (CustomOp,), {}))


def test_a_reference_is_built_with_the_layers_arguments_and_weights() -> None:
    class Kernel(SiluAndMul):
        def forward_native(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward_native(x)

    act = construct(Kernel)
    mlp = construct(GluMLP, 8, 6, act, False, False, torch.float32)
    torch.nn.init.normal_(mlp.gate_up_proj.weight)
    torch.nn.init.normal_(mlp.down_proj.weight)
    reference = reference_of(mlp)
    assert type(reference) is GluMLP and type(reference.act_fn) is SiluAndMul  # sublayers too
    x = torch.randn(3, 8)
    torch.testing.assert_close(2 * reference(x), mlp(x))
    rows = describe_layers(torch.nn.Sequential(mlp))
    assert [(row["module"], row["op"], row["forward"]) for row in rows] == [
        ("0", "glu_mlp", "forward_native"),
        ("0.act_fn", "silu_and_mul", "forward_native"),
    ]


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

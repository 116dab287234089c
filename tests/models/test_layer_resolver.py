"""The resolver: hw-agnostic when asked and available, the default otherwise, per symbol and per
activation name, with a log line saying which and why."""

from __future__ import annotations

import logging

import pytest

from strata.config import LayerConfig, set_current_layer_config
from strata.hw_agnostic.layers import activation as hw_activation
from strata.hw_agnostic.layers import layernorm as hw_layernorm
from strata.layers import activation, layernorm, mlp
from strata.layers.activation import UnknownActivationError
from strata.models.transformers.layers import get_act_and_mul_fn, resolve

DEFAULT = LayerConfig(layer_impl="default")
HW = LayerConfig(layer_impl="hw-agnostic")


def test_switch_off_and_on(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="strata.layers")
    assert resolve("layernorm", "RMSNorm", DEFAULT) is layernorm.RMSNorm
    assert resolve("layernorm", "RMSNorm", HW) is hw_layernorm.RMSNorm
    assert resolve("layernorm", "GemmaRMSNorm", HW) is hw_layernorm.GemmaRMSNorm
    assert caplog.messages[:2] == [
        "layer RMSNorm: default (layer_impl=default)",
        "layer RMSNorm: hw-agnostic (strata.hw_agnostic.layers.layernorm)",
    ]


def test_the_current_layer_config_is_the_default_argument() -> None:
    with set_current_layer_config(HW):
        assert resolve("layernorm", "RMSNorm") is hw_layernorm.RMSNorm
        assert type(get_act_and_mul_fn("silu")) is hw_activation.SiluAndMul
    with set_current_layer_config(DEFAULT):
        assert resolve("layernorm", "RMSNorm") is layernorm.RMSNorm


def test_missing_symbol_and_missing_module_fall_back(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata.layers")
    monkeypatch.delattr(hw_layernorm, "GemmaRMSNorm")
    assert resolve("layernorm", "GemmaRMSNorm", HW) is layernorm.GemmaRMSNorm
    assert resolve("layernorm", "RMSNorm", HW) is hw_layernorm.RMSNorm  # the other symbol is unaffected
    assert resolve("mlp", "GluMLP", HW) is mlp.GluMLP  # there is no strata.hw_agnostic.layers.mlp
    assert (
        "layer GemmaRMSNorm: default (strata.hw_agnostic.layers.layernorm has no GemmaRMSNorm)"
        in caplog.messages
    )
    assert (
        "layer GluMLP: default (there is no hw-agnostic module strata.hw_agnostic.layers.mlp)"
        in caplog.messages
    )


def test_activation_falls_back_per_name(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="strata.layers")
    monkeypatch.delitem(hw_activation.ACT_AND_MUL, "gelu")
    gelu = get_act_and_mul_fn("gelu", HW)
    assert type(gelu) is activation.GeluAndMul and gelu.approximate == "none"
    assert type(get_act_and_mul_fn("silu", HW)) is hw_activation.SiluAndMul
    assert "activation gelu: default (no hw-agnostic act-and-mul layer for it)" in caplog.messages
    with pytest.raises(UnknownActivationError, match="relu2"):
        get_act_and_mul_fn("relu2", HW)

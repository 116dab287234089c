"""The int8 weight-only linear layer: per-channel quantization, every forward method against a float matmul."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

from strata.hw_agnostic.layers import quantization as hw_quantization
from strata.hw_agnostic.layers.quantization import quantize_per_channel
from strata.platforms.cpu import kernels
from strata.platforms.cpu import layers as cpu_layers

from resolved_layers import build_layer

# Input widths: a multiple of 16 (ATen's int8 kernel runs) and one that is not (it falls back).
IN_FEATURES = [64, 40]
# 1 and 3 tokens take an int8 kernel, 20 the bfloat16 matmul of the widened weight.
TOKENS = [1, 3, 20]


@pytest.fixture(params=["strata", "aten"])
def kernel(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The CPU layer the resolver picks with Strata's C++ kernel, or without a C++ compiler (ATen's
    `_weight_int8pack_mm`)."""
    if request.param == "aten":
        monkeypatch.setattr(kernels, "load", lambda name: False)
    elif not kernels.load("small_batch_linear"):
        pytest.skip("Strata's CPU kernel cannot be built here (no C++ compiler, or turned off)")
    return request.param


def _cpu_layer(in_features: int, out_features: int, bias: bool) -> torch.nn.Module:
    """The int8 linear the CPU platform resolves to: `CpuInt8Linear` where the kernel loads, else ATen's."""
    layer = build_layer("int8_linear", in_features, out_features, bias=bias)
    assert layer.forward_method_name == "forward_cpu"
    expected = cpu_layers.CpuInt8Linear if kernels.load("small_batch_linear") else cpu_layers.AtenInt8Linear
    assert type(layer) is expected
    return layer


def _layer(
    make: Callable[..., torch.nn.Module], in_features: int, bias: bool, seed: int = 0
) -> tuple[torch.nn.Module, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(48, in_features, generator=generator) * 0.1
    layer = make(in_features, 48, bias=bias)
    layer.load_float_weight(weight)
    if bias:
        layer.bias.data = torch.randn(48, generator=generator)
    return layer, weight


def test_quantize_per_channel_is_symmetric_and_within_half_a_step() -> None:
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(1))
    weight[3] = 0.0
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (8,)
    assert q.abs().max() == 127 and scale[3] == 1.0 and not q[3].any()
    torch.testing.assert_close(scale[0], weight[0].abs().max() / 127)
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


@pytest.mark.parametrize("in_features", IN_FEATURES)
@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_methods_match_float_matmul(in_features: int, tokens: int, bias: bool, kernel: str) -> None:
    layer, weight = _layer(_cpu_layer, in_features, bias)
    reference, _ = _layer(hw_quantization.Int8Linear, in_features, bias)
    x = torch.randn(2, tokens, in_features, generator=torch.Generator().manual_seed(2))
    dequantized = layer.qweight.float() * layer.scale[:, None]
    exact = F.linear(x, dequantized, layer.bias)
    # forward_native and the hw-agnostic reference compute the dequantized matmul in float32.
    torch.testing.assert_close(layer.forward_native(x), exact, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(reference.forward_native(x), exact, atol=1e-5, rtol=1e-5)
    # forward_cpu may round activations and the kernel's output to bfloat16 (8 significant bits): 2^-8
    # relative per value, so 1% of the output's magnitude bounds it.
    scale = exact.abs().max().item()
    torch.testing.assert_close(layer.forward_cpu(x), exact, atol=1e-2 * scale, rtol=0)
    # Against the unquantized weight: each weight is off by at most half its row's step (max|row| / 254),
    # so the error of an output is at most sum|x| * max|row| / 254; the bfloat16 rounding adds its 1%.
    bound = x.abs().sum(-1, keepdim=True) * weight.abs().amax(1) / 254 + 1e-2 * scale
    for method in ("forward_native", "forward_cpu"):
        float_out = F.linear(x, weight, layer.bias)
        assert ((getattr(layer, method)(x) - float_out).abs() <= bound).all(), method


def test_forward_cpu_in_bfloat16_and_with_a_misaligned_input(kernel: str) -> None:
    layer, _ = _layer(_cpu_layer, 64, bias=True)
    layer.scale.data = layer.scale.data.to(torch.bfloat16)
    layer.bias.data = layer.bias.data.to(torch.bfloat16)
    # A contiguous view 8 values into a buffer: its data does not start on a 64-byte boundary.
    buffer = torch.randn(4 * 64, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    x = buffer[8 : 8 + 3 * 64].view(3, 64)
    assert x.data_ptr() % 64
    out = layer.forward_cpu(x)
    assert out.dtype == torch.bfloat16 and out.shape == (3, 48)
    expected = layer.forward_native(x.float().to(torch.bfloat16))
    torch.testing.assert_close(out.float(), expected.float(), atol=2e-2 * expected.abs().max().item(), rtol=0)


def test_load_float_weight_checks_the_shape() -> None:
    layer = hw_quantization.Int8Linear(64, 48)
    with pytest.raises(ValueError, match=r"\(48, 32\) does not fit an int8 linear of 64 -> 48"):
        layer.load_float_weight(torch.zeros(48, 32))


def test_forward_cpu_traces_as_one_graph(kernel: str) -> None:
    """torch.compile (Dynamo) traces forward_cpu without graph breaks, whichever kernel was picked."""
    layer, _ = _layer(_cpu_layer, 64, bias=True)
    compiled = torch.compile(layer.forward_cpu, backend="eager", fullgraph=True, dynamic=True)
    for tokens in (1, 5):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
        torch.testing.assert_close(compiled(x), layer.forward_cpu(x), atol=1e-2, rtol=1e-2)


def test_int8_weights_keep_one_byte_a_weight_after_loading() -> None:
    """The loader's hook keeps no bfloat16 copy of the int8 weights (it would take twice their memory): every
    width reads the int8 weights themselves, wide inputs widening them for the call."""
    if not kernels.load("small_batch_linear"):
        pytest.skip("Strata's CPU kernel cannot be built here (no C++ compiler, or turned off)")
    layer, _ = _layer(_cpu_layer, 64, bias=True)
    x = torch.randn(20, 64, generator=torch.Generator().manual_seed(5))
    before = layer.forward_cpu(x)
    held = {name: t.data_ptr() for name, t in layer.state_dict().items()}
    layer.process_weights_after_loading()
    assert {name: t.data_ptr() for name, t in layer.state_dict().items()} == held
    assert not hasattr(layer, "_packed_weight")
    torch.testing.assert_close(layer.forward_cpu(x), before, rtol=0, atol=0)
    # A write through `.data` bypasses the version counter: every width sees it, so none reads a copy.
    layer.qweight.data.neg_()
    for rows in (8, 20):
        flipped = layer.forward_cpu(x[:rows]) - layer.bias
        torch.testing.assert_close(flipped, -(before[:rows] - layer.bias), rtol=1e-2, atol=1e-2)

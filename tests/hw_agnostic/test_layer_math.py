"""Every op's reference (`forward_native`) and every platform implementation this machine can run compute
what HF's modules compute."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from strata.custom_op import op_registry
from strata.hw_agnostic.layers import activation as hw_activation
from strata.hw_agnostic.layers import layernorm as hw_layernorm
from strata.hw_agnostic.layers.activation import UnknownActivationError, act_and_mul_op
from strata.platforms import get_platform, platform_names


def implementations(op_name: str, *args: Any, **kwargs: Any) -> list[tuple[type, str]]:
    """The op's reference with `forward_native`, and each in-tree platform's implementations with their
    platform's forward method, where they can serve a layer built with these arguments here (their kernel
    builds, Triton is installed)."""
    found = [(op_registry[op_name].reference, "forward_native")]
    for name in platform_names():
        platform = get_platform(name)
        if not platform.is_available():
            continue
        platform.load_layers()
        for cls in op_registry[op_name].implementations.get(name, []):
            if cls.supports(*args, **kwargs) is None:
                found.append((cls, platform.forward_method))
    return found


def _id(value: object) -> str:
    return f"{value[0].__name__}.{value[1]}" if isinstance(value, tuple) else getattr(value, "__name__", "")


def _random_weight(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(3))


NORMS = [
    (impl, hf)
    for op, hf in (("rms_norm", LlamaRMSNorm), ("gemma_rms_norm", Gemma3RMSNorm))
    for impl in implementations(op, 32, 1e-5)
]


@pytest.mark.parametrize(("impl", "theirs"), NORMS, ids=_id)
def test_rms_norms_match_hf(impl: tuple[type, str], theirs: type) -> None:
    ours, method = impl
    norm, hf = ours(32, 1e-5), theirs(32, eps=1e-5)
    norm.weight.data = hf.weight.data = _random_weight(32)
    x, residual = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    forward = getattr(norm, method)
    torch.testing.assert_close(forward(x), hf(x))
    out, new_residual = forward(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, hf(x + residual))


@pytest.mark.parametrize("impl", implementations("layer_norm", 32, 1e-5), ids=_id)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norms_match_torch(impl: tuple[type, str], bias: bool) -> None:
    ours, method = impl
    norm, reference = ours(32, 1e-5, bias), torch.nn.LayerNorm(32, eps=1e-5, bias=bias)
    norm.weight.data = reference.weight.data = _random_weight(32)
    if bias:
        norm.bias.data = reference.bias.data = _random_weight(32) - 0.5
    else:
        assert norm.bias is None
    x = torch.randn(2, 5, 32) * 4 + 3  # a mean far from zero, which the norm must take out
    torch.testing.assert_close(getattr(norm, method)(x), reference(x))


def test_hw_agnostic_norm_keeps_float32_math_in_bfloat16() -> None:
    norm = hw_layernorm.GemmaRMSNorm(32, 1e-6, dtype=torch.bfloat16)
    norm.weight.data = _random_weight(32).to(torch.bfloat16)
    x = torch.randn(4, 32).to(torch.bfloat16)
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    expected = (h * (1 + norm.weight.float())).to(torch.bfloat16)
    assert torch.equal(norm.forward_native(x), expected)


ACTIVATION_NAMES = ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"]


@pytest.mark.parametrize("name", ACTIVATION_NAMES)
def test_act_and_mul_matches_hf_activation(name: str) -> None:
    op_name, kwargs = act_and_mul_op(name)
    gate, up = torch.randn(3, 16) * 3, torch.randn(3, 16)
    expected = ACT2FN[name](gate) * up
    for cls, method in implementations(op_name, **kwargs):
        op = cls(**kwargs)
        torch.testing.assert_close(getattr(op, method)(torch.cat([gate, up], -1)), expected)


def test_unknown_activation_is_a_clear_error() -> None:
    with pytest.raises(UnknownActivationError, match=r"'relu2'.*known: gelu"):
        act_and_mul_op("relu2")
    with pytest.raises(ValueError, match="approximate"):
        hw_activation.GeluAndMul(approximate="erf")


TRITON_CHECK = """
import torch
from strata.platforms.cuda import layers
device = "cuda" if torch.cuda.is_available() else "cpu"
for cls in (layers.CudaRMSNorm, layers.CudaGemmaRMSNorm):
    for dtype in (torch.float32, torch.float16):
        norm = cls(100, 1e-5, dtype=dtype).to(device)
        norm.weight.data = torch.randn(100, device=device).to(dtype)
        x, r = (torch.randn(2, 3, 100, device=device).to(dtype) for _ in range(2))
        torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x))
        (out, res), (want, want_res) = norm.forward_cuda(x, r), norm.forward_native(x, r)
        torch.testing.assert_close(out, want)
        assert torch.equal(res, want_res)
for op in (layers.CudaSiluAndMul(), layers.CudaGeluAndMul("none"), layers.CudaGeluAndMul("tanh")):
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(2, 3, 2 * 1100, device=device) * 3).to(dtype)
        want = op.forward_native(x.float()).to(dtype)
        torch.testing.assert_close(op.forward_cuda(x), want, atol=1e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)
print("ok")
"""


def test_triton_kernels_match_forward_native() -> None:
    """The CUDA kernels, on a GPU where there is one, else in Triton's interpreter (skipped without Triton)."""
    pytest.importorskip("triton")
    from strata.platforms.cuda.layers import triton_kernels

    assert triton_kernels() is not None
    env = {**os.environ, "TRITON_INTERPRET": "0" if torch.cuda.is_available() else "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

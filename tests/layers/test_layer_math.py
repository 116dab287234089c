"""Default and hw-agnostic layers compute what HF's modules compute, in every forward method."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from transformers.activations import ACT2FN
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from strata.hw_agnostic.layers import activation as hw_activation
from strata.hw_agnostic.layers import layernorm as hw_layernorm
from strata.layers import activation, layernorm
from strata.layers.activation import UnknownActivationError

NORM_CLASSES = [
    (layernorm.RMSNorm, LlamaRMSNorm),
    (hw_layernorm.RMSNorm, LlamaRMSNorm),
    (layernorm.GemmaRMSNorm, Gemma3RMSNorm),
    (hw_layernorm.GemmaRMSNorm, Gemma3RMSNorm),
]
METHODS = ["forward_native", "forward_cpu", "forward_cuda"]  # forward_cuda falls back to ATen off-GPU


def _random_weight(n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize(("ours", "theirs"), NORM_CLASSES)
@pytest.mark.parametrize("method", METHODS)
def test_rms_norms_match_hf(ours: type, theirs: type, method: str) -> None:
    norm, hf = ours(32, 1e-5), theirs(32, eps=1e-5)
    norm.weight.data = hf.weight.data = _random_weight(32)
    x, residual = torch.randn(2, 5, 32), torch.randn(2, 5, 32)
    forward = getattr(norm, method)
    torch.testing.assert_close(forward(x), hf(x))
    out, new_residual = forward(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(out, hf(x + residual))


@pytest.mark.parametrize("ours", [layernorm.LayerNorm, hw_layernorm.LayerNorm])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("bias", [True, False])
def test_layer_norms_match_torch(ours: type, method: str, bias: bool) -> None:
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


@pytest.mark.parametrize("module", [activation, hw_activation])
@pytest.mark.parametrize("name", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "gelu_new", "gelu_fast"])
def test_act_and_mul_matches_hf_activation(module: object, name: str) -> None:
    op = module.get_act_and_mul_fn(name)  # type: ignore[attr-defined]
    gate, up = torch.randn(3, 16) * 3, torch.randn(3, 16)
    expected = ACT2FN[name](gate) * up
    for method in ("forward_native", "forward_cpu", "forward_cuda", "forward"):
        torch.testing.assert_close(getattr(op, method)(torch.cat([gate, up], -1)), expected)


def test_unknown_activation_is_a_clear_error() -> None:
    with pytest.raises(UnknownActivationError, match=r"'relu2'.*known: gelu"):
        activation.get_act_and_mul_fn("relu2")
    with pytest.raises(KeyError):
        hw_activation.get_act_and_mul_fn("relu2")
    with pytest.raises(ValueError, match="approximate"):
        activation.GeluAndMul(approximate="erf")


TRITON_CHECK = """
import torch
from strata.layers import activation, layernorm
device = "cuda" if torch.cuda.is_available() else "cpu"
for cls in (layernorm.RMSNorm, layernorm.GemmaRMSNorm):
    for dtype in (torch.float32, torch.float16):
        norm = cls(100, 1e-5, dtype=dtype).to(device)
        norm.weight.data = torch.randn(100, device=device).to(dtype)
        x, r = (torch.randn(2, 3, 100, device=device).to(dtype) for _ in range(2))
        torch.testing.assert_close(norm.forward_cuda(x), norm.forward_native(x))
        (out, res), (want, want_res) = norm.forward_cuda(x, r), norm.forward_native(x, r)
        torch.testing.assert_close(out, want)
        assert torch.equal(res, want_res)
for op in (activation.SiluAndMul(), activation.GeluAndMul("none"), activation.GeluAndMul("tanh")):
    for dtype in (torch.float32, torch.float16):
        x = (torch.randn(2, 3, 2 * 1100, device=device) * 3).to(dtype)
        want = op.forward_native(x.float()).to(dtype)
        torch.testing.assert_close(op.forward_cuda(x), want, atol=1e-3 if dtype == torch.float16 else 1e-5, rtol=1e-3)
print("ok")
"""


def test_triton_kernels_match_forward_native() -> None:
    """The CUDA kernels, on a GPU where there is one, else in Triton's interpreter (skipped without Triton)."""
    pytest.importorskip("triton")
    from strata.layers import load_triton_kernels

    assert load_triton_kernels() is not None
    env = {**os.environ, "TRITON_INTERPRET": "0" if torch.cuda.is_available() else "1"}
    done = subprocess.run(
        [sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr

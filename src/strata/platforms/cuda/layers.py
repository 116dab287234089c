"""The CUDA platform's implementations of Strata's ops: Triton kernels that read their input once and write
once (the RMSNorm with its residual add, the act-and-mul with its product). They need Triton; without it
they decline and the references serve."""

from __future__ import annotations

import functools
import importlib
from types import ModuleType
from typing import Any

import torch

from strata.custom_op import register_implementation
from strata.hw_agnostic.layers import GeluAndMul, RMSNorm, SiluAndMul
from strata.hw_agnostic.layers.layernorm import GemmaRMSNorm


@functools.cache
def triton_kernels() -> ModuleType | None:
    """`strata.platforms.cuda.triton_kernels`, or None where Triton is not installed."""
    try:
        return importlib.import_module("strata.platforms.cuda.triton_kernels")
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            raise
        return None


def _needs_triton(*args: Any, **kwargs: Any) -> str | None:
    return None if triton_kernels() is not None else "Triton is not installed"


class _TritonRMSNorm:
    """`forward_cuda` of both RMSNorms: one program per row, the residual add fused in."""

    weight: torch.Tensor
    variance_epsilon: float
    weight_offset: bool  # Gemma's `1 + weight`
    supports = classmethod(_needs_triton)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        out, new_residual = triton_kernels().rms_norm(  # type: ignore[union-attr]
            x, self.weight, self.variance_epsilon, residual, self.weight_offset
        )
        return out if new_residual is None else (out, new_residual)


@register_implementation("cuda")
class CudaRMSNorm(_TritonRMSNorm, RMSNorm):
    weight_offset = False


@register_implementation("cuda")
class CudaGemmaRMSNorm(_TritonRMSNorm, GemmaRMSNorm):
    weight_offset = True


@register_implementation("cuda")
class CudaSiluAndMul(SiluAndMul):
    supports = classmethod(_needs_triton)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        return triton_kernels().act_and_mul(x, "silu")  # type: ignore[union-attr]


@register_implementation("cuda")
class CudaGeluAndMul(GeluAndMul):
    supports = classmethod(_needs_triton)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        activation = "gelu_tanh" if self.approximate == "tanh" else "gelu"
        return triton_kernels().act_and_mul(x, activation)  # type: ignore[union-attr]

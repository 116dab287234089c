"""Normalisation ops: RMSNorm (Llama's and Gemma's) and LayerNorm, every step in float32, cast back once."""

from __future__ import annotations

import torch
from torch import nn

from strata.custom_op import CustomOp


def _rms_norm_fp32(
    x: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalised `x (+ residual)` in float32, and the summed residual in the input dtype (which is what is
    normalised, as HF adds the residual in the model's dtype before the norm)."""
    new_residual = None if residual is None else (x.float() + residual.float()).to(x.dtype)
    h = (x if new_residual is None else new_residual).float()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), new_residual


@CustomOp.register("rms_norm")
class RMSNorm(CustomOp):
    """`weight * x / sqrt(mean(x^2) + eps)` over the last dimension: the statistics in float32, the weight
    applied to the normalised x in x's dtype, as HF's Llama does (so a float32 weight gives float32 output).

    Given a `residual`, the op first adds it to `x` and returns `(normed, x + residual)`.
    """

    weight_init: float = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            torch.full((hidden_size,), self.weight_init, dtype=dtype), requires_grad=False
        )

    def scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The normalised float32 rows `h` times the weight, for inputs of `dtype`."""
        return self.weight * h.to(dtype)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = _rms_norm_fp32(x, residual, self.variance_epsilon)
        out = self.scale(h, x.dtype)
        return out if new_residual is None else (out, new_residual)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}, forward={self.forward_method_name}"

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        def sample() -> torch.Tensor:
            x = torch.randn(num_tokens, self.hidden_size, generator=generator)
            return x.to(device=self.weight.device, dtype=dtype)

        return [(sample(),), (sample(), sample())]


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: scales by `1 + weight` (the checkpoint stores the offset), all in float32."""

    weight_init = 0.0

    def scale(self, h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return (h * (1.0 + self.weight.float())).to(dtype)


@CustomOp.register("layer_norm")
class LayerNorm(CustomOp):
    """`(x - mean(x)) / sqrt(var(x) + eps)` over the last dimension, times a per-channel weight plus a bias
    (GPT-2, GPT-NeoX, OPT, Phi, Starcoder2); parameters named as `nn.LayerNorm` names them."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False) if bias else None

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        centered = h - h.mean(-1, keepdim=True)
        h = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * self.weight.float()
        if self.bias is not None:
            h = h + self.bias.float()
        return h.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}, forward={self.forward_method_name}"

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        x = torch.randn(num_tokens, self.hidden_size, generator=generator) * 3 + 1
        return [(x.to(device=self.weight.device, dtype=dtype),)]

"""hw-agnostic RMSNorms and LayerNorm: every step in float32, cast back once, so all backends produce the same
numbers."""

from __future__ import annotations

import torch

from strata.custom_op import CustomOp
from strata.layers.base import LayerNormBase, RMSNormBase


def _rms_norm_fp32(
    x: torch.Tensor, residual: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Normalised `x (+ residual)` in float32, and the summed residual in the input dtype."""
    h = x.float()
    new_residual = None
    if residual is not None:
        h = h + residual.float()
        new_residual = h.to(x.dtype)
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps), new_residual


@CustomOp.register("rms_norm")
class RMSNorm(RMSNormBase):
    """`weight * x / rms(x)`, with the weight applied in its own dtype as HF's Llama does."""

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = _rms_norm_fp32(x, residual, self.variance_epsilon)
        out = (h.to(self.weight.dtype) * self.weight).to(x.dtype)
        return out if new_residual is None else (out, new_residual)


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(RMSNormBase):
    """`(1 + weight) * x / rms(x)`, the weight offset added in float32."""

    weight_init = 0.0

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        h, new_residual = _rms_norm_fp32(x, residual, self.variance_epsilon)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if new_residual is None else (out, new_residual)


@CustomOp.register("layer_norm")
class LayerNorm(LayerNormBase):
    """Mean and (biased) variance in float32, then the weight and bias, as a formula of plain tensor ops."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        mean = h.mean(-1, keepdim=True)
        centered = h - mean
        h = centered * torch.rsqrt(centered.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h * self.weight.float()
        if self.bias is not None:
            h = h + self.bias.float()
        return h.to(x.dtype)

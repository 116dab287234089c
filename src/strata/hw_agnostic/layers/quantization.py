"""The int8 weight-only linear op: per-output-channel symmetric int8 weights times a float scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.custom_op import CustomOp
from strata.hw_agnostic.layers.linear import LinearShape


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (row): `weight ~= q * scale[:, None]`, `scale = max|row| / 127`.

    Computed in float32 whatever the input dtype; an all-zero row gets scale 1 so nothing divides by zero.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


@CustomOp.register("int8_linear")
class Int8Linear(LinearShape):
    """`x @ (qweight * scale[:, None]).T + bias`, in float32 and cast back once.

    Parameters: `qweight` (int8, `[out, in]`), `scale` (`[out]`, the model dtype) and the optional `bias`.
    The loader calls `load_float_weight` with each checkpoint weight (after merging shards), so only one
    floating-point tensor is held at a time while a model loads.
    """

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.qweight = nn.Parameter(
            torch.zeros(out_features, in_features, dtype=torch.int8), requires_grad=False
        )
        self.scale = nn.Parameter(torch.ones(out_features, dtype=dtype), requires_grad=False)

    def load_float_weight(self, weight: torch.Tensor) -> None:
        """Quantize a `[out, in]` floating-point weight into `qweight` and `scale` (in the model dtype)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(
                f"weight of shape {tuple(weight.shape)} does not fit an int8 linear of "
                f"{self.in_features} -> {self.out_features}"
            )
        q, scale = quantize_per_channel(weight)
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scale = nn.Parameter(scale.to(self.scale.dtype), requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.float(), self.qweight.float()) * self.scale.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

"""hw-agnostic int8 weight-only linear: the int8 weights widened to float32 and one float32 matmul."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp
from strata.layers.base import Int8LinearBase


@CustomOp.register("int8_linear")
class Int8Linear(Int8LinearBase):
    """`x @ (qweight * scale).T + bias` in float32, cast back once: the default layer's reference."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x.float(), self.qweight.float()) * self.scale.float()
        if self.bias is not None:
            out = out + self.bias.float()
        return out.to(x.dtype)

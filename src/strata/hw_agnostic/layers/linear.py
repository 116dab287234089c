"""hw-agnostic Linear: plain `F.linear`, no per-platform kernel; PyTorch's matmuls already accumulate
low-precision inputs in float32, and upcasting the weight each call would double the bytes read."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp
from strata.layers.base import LinearBase


@CustomOp.register("linear")
class Linear(LinearBase):
    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

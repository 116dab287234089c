"""Linear ops: `x @ weight.T + bias`, with `nn.Linear`'s parameter names so checkpoints load unchanged.

The reference is `F.linear` itself: PyTorch's matmuls accumulate low-precision inputs in float32 already,
and upcasting the weight each call would double the bytes read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strata.custom_op import CustomOp


class LinearShape(CustomOp):
    """What every linear op shares: its sizes, the optional bias, the repr and the verification inputs."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, forward={self.forward_method_name}"
        )

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        x = torch.randn(num_tokens, self.in_features, generator=generator)
        return [(x.to(device=next(self.parameters()).device, dtype=dtype),)]


@CustomOp.register("linear")
class Linear(LinearShape):
    """A dense linear layer: what `nn.Linear` computes."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

"""The GLU MLP as one pluggable layer: gate and up projections merged into a single matmul."""

from __future__ import annotations

import torch
from torch import nn

from strata.custom_op import PluggableLayer


@PluggableLayer.register("glu_mlp")
class GluMLP(PluggableLayer):
    """`down(act_and_mul(gate_up(x)))`, the same function as HF's `down(act(gate(x)) * up(x))`.

    One `[gate; up]` matmul reads `x` once instead of twice; `act_and_mul` is a resolved act-and-mul layer.
    The projections start as `nn.Linear`s, which the loader replaces by resolved linear layers.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        act_and_mul: nn.Module,
        bias: bool = False,
        down_bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.act_fn = act_and_mul
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=down_bias, dtype=dtype)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"forward={self.forward_method_name}"

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        x = torch.randn(num_tokens, self.hidden_size, generator=generator)
        return [(x.to(device=next(self.parameters()).device, dtype=dtype),)]

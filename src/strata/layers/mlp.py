"""The GLU MLP as one pluggable layer: gate and up projections merged into a single matmul."""

from __future__ import annotations

import torch
from torch import nn

from strata.custom_op import PluggableLayer
from strata.layers.activation import GeluAndMul, SiluAndMul
from strata.layers.linear import Linear, is_bf16x3_copy, prepacked_copy
from strata.process_local import ProcessLocalValue


def fusable_activation(act_and_mul: nn.Module) -> str | None:
    """The activation `strata_cpu::linear_glu` computes for this act-and-mul layer, or None: only Strata's own
    SiLU and tanh-GELU layers on their CPU path (a plugin's override, or the hw-agnostic path, keeps its layer)."""
    if getattr(act_and_mul, "forward_method_name", None) != "forward_cpu":
        return None
    if type(act_and_mul) is SiluAndMul:
        return "silu"
    if type(act_and_mul) is GeluAndMul and act_and_mul.approximate == "tanh":
        return "gelu_tanh"
    return None


@PluggableLayer.register("glu_mlp")
class GluMLP(PluggableLayer):
    """`down(act_and_mul(gate_up(x)))`, the same function as HF's `down(act(gate(x)) * up(x))`.

    One `[gate; up]` matmul reads `x` once instead of twice; `act_and_mul` is a resolved act-and-mul layer.
    On the CPU, when the projection and the activation are Strata's own, the two run as one op
    (`strata_cpu::linear_glu`): the activation is applied to the GEMM's sums in registers, so the [tokens,
    2 x intermediate] product never goes to memory and back.
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
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=bias, dtype=dtype)
        self.act_fn = act_and_mul
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=down_bias, dtype=dtype)
        # Set where `linear_glu` serves (`process_weights_after_loading`).
        self.fused_activation: str | None = None
        self._glu_panels: ProcessLocalValue[torch.Tensor] | None = None

    def process_weights_after_loading(self) -> None:
        """Pack `[gate; up]` for `strata_cpu::linear_glu` where it serves this layer (Strata's Linear with its
        prepacked copies, no bias, an activation it computes, float32 panels on this CPU); that copy replaces
        the projection's own."""
        gate_up, activation = self.gate_up_proj, fusable_activation(self.act_fn)
        if (
            activation is None
            or type(gate_up) is not Linear
            or not gate_up.prepack
            or gate_up.bias is not None
        ):
            return
        self._glu_panels = prepacked_copy(gate_up.weight, activation, gate_up.fp32_matmul_precision)
        if self._glu_panels is not None:
            self.fused_activation = activation
            bf16x3 = ", bf16x3 from 4 rows" if is_bf16x3_copy(gate_up.weight, self._glu_panels) else ""
            self.forward_method_name = (
                f"forward (strata_cpu::linear_glu, {activation}{bf16x3})"  # what reports show
            )
            gate_up.prepack, gate_up._packed_weight = False, None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused_activation is not None:
            rows = x.reshape(-1, x.shape[-1])
            hidden = torch.ops.strata_cpu.linear_glu(rows, self.gate_up_proj.weight, self.fused_activation)
            return self.down_proj(hidden.view(*x.shape[:-1], hidden.shape[-1]))
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def extra_repr(self) -> str:
        return f"fused_activation={self.fused_activation}" if self.fused_activation else ""

"""Default act-and-mul layers for GLU MLPs: in the input dtype with in-place multiplies on CPU, a fused
Triton kernel on CUDA (the CPU path where Triton is not installed)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp
from strata.layers import load_triton_kernels
from strata.layers.base import ActAndMulBase, GeluAndMulBase, act_and_mul_table


def _halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


@CustomOp.register("silu_and_mul")
class SiluAndMul(ActAndMulBase):
    """SwiGLU: `silu(gate) * up`."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.silu(gate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.silu(gate).mul_(up)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        kernels = load_triton_kernels()
        return self.forward_cpu(x) if kernels is None else kernels.act_and_mul(x, "silu")


@CustomOp.register("gelu_and_mul")
class GeluAndMul(GeluAndMulBase):
    """GeGLU: `gelu(gate) * up`, exact (`approximate="none"`) or with the tanh approximation."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.gelu(gate, approximate=self.approximate) * up

    def forward_cpu(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = _halves(x)
        return F.gelu(gate, approximate=self.approximate).mul_(up)

    def forward_cuda(self, x: torch.Tensor) -> torch.Tensor:
        kernels = load_triton_kernels()
        activation = "gelu_tanh" if self.approximate == "tanh" else "gelu"
        return self.forward_cpu(x) if kernels is None else kernels.act_and_mul(x, activation)


ACT_AND_MUL: dict[str, Callable[[], CustomOp]] = act_and_mul_table(SiluAndMul, GeluAndMul)


class UnknownActivationError(KeyError, ValueError):
    """No act-and-mul layer for this HF activation name."""


def get_act_and_mul_fn(name: str) -> CustomOp:
    """The act-and-mul layer for HF activation `name` (as in `config.hidden_act`)."""
    if name not in ACT_AND_MUL:
        raise UnknownActivationError(
            f"activation {name!r} has no act-and-mul layer; known: {', '.join(sorted(ACT_AND_MUL))}"
        )
    return ACT_AND_MUL[name]()

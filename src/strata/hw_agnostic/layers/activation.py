"""hw-agnostic act-and-mul layers: plain PyTorch in float32; HF activation names map to them."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp
from strata.layers.base import ActAndMulBase, GeluAndMulBase, act_and_mul_table

# HF activation name -> the activation itself; the fuser also uses these to recognise an MLP's `act_fn`.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": partial(F.gelu, approximate="none"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
}


def _act_and_mul_fp32(act: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    d = x.shape[-1] // 2
    h = x.float()
    return (act(h[..., :d]) * h[..., d:]).to(x.dtype)


@CustomOp.register("silu_and_mul")
class SiluAndMul(ActAndMulBase):
    """SwiGLU: `silu(gate) * up` in float32."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _act_and_mul_fp32(F.silu, x)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(GeluAndMulBase):
    """GeGLU: `gelu(gate) * up` in float32, exact or tanh-approximated."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return _act_and_mul_fp32(partial(F.gelu, approximate=self.approximate), x)


ACT_AND_MUL: dict[str, Callable[[], CustomOp]] = act_and_mul_table(SiluAndMul, GeluAndMul)


def get_act_and_mul_fn(name: str) -> CustomOp:
    """The hw-agnostic act-and-mul layer for HF activation `name`; KeyError when there is none."""
    return ACT_AND_MUL[name]()

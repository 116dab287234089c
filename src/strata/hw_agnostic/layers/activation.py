"""Act-and-mul ops for GLU MLPs: `act(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2`, in float32.

HF configs name the activation (`hidden_act`); `act_and_mul_op` maps that name to the op computing it.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp

# HF activation name -> the activation itself; the fuser also uses these to recognise an MLP's `act_fn`.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": partial(F.gelu, approximate="none"),
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_new": partial(F.gelu, approximate="tanh"),
    "gelu_fast": partial(F.gelu, approximate="tanh"),
}

# HF activation name -> the act-and-mul op and its constructor arguments; gelu_new and gelu_fast are tanh.
_ACT_AND_MUL_OPS: dict[str, tuple[str, dict[str, Any]]] = {
    "silu": ("silu_and_mul", {}),
    "swish": ("silu_and_mul", {}),
    "gelu": ("gelu_and_mul", {"approximate": "none"}),
    "gelu_pytorch_tanh": ("gelu_and_mul", {"approximate": "tanh"}),
    "gelu_new": ("gelu_and_mul", {"approximate": "tanh"}),
    "gelu_fast": ("gelu_and_mul", {"approximate": "tanh"}),
}

# Width of the random inputs of `strata layers --verify`.
_VERIFY_WIDTH = 128


class UnknownActivationError(KeyError, ValueError):
    """No act-and-mul op for this HF activation name."""


def act_and_mul_op(name: str) -> tuple[str, dict[str, Any]]:
    """The act-and-mul op for HF activation `name` (as in `config.hidden_act`) and its constructor arguments."""
    if name not in _ACT_AND_MUL_OPS:
        raise UnknownActivationError(
            f"activation {name!r} has no act-and-mul layer; known: {', '.join(sorted(_ACT_AND_MUL_OPS))}"
        )
    return _ACT_AND_MUL_OPS[name]


def halves(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gate and up halves of an act-and-mul input."""
    d = x.shape[-1] // 2
    return x[..., :d], x[..., d:]


class _ActAndMul(CustomOp):
    """What the act-and-mul ops share: the activation in float32, then the product, cast back once."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = halves(x.float())
        return (self.activation(gate) * up).to(x.dtype)

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        return [(torch.randn(num_tokens, _VERIFY_WIDTH, generator=generator).to(dtype),)]


@CustomOp.register("silu_and_mul")
class SiluAndMul(_ActAndMul):
    """SwiGLU: `silu(gate) * up`."""

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.silu(gate)


@CustomOp.register("gelu_and_mul")
class GeluAndMul(_ActAndMul):
    """GeGLU: `gelu(gate) * up`, exact (`approximate="none"`) or with the tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def activation(self, gate: torch.Tensor) -> torch.Tensor:
        return F.gelu(gate, approximate=self.approximate)

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, forward={self.forward_method_name}"

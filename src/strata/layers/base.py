"""What the default and the hw-agnostic layers share: parameters, constructor and verification inputs.

Only the math differs between the two providers, so each provider's classes subclass these bases and
implement the forward methods.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from strata.custom_op import CustomOp

# Width of the random inputs of `strata layers --verify` for elementwise act-and-mul ops.
_VERIFY_ACT_WIDTH = 128


class RMSNormBase(CustomOp):
    """`x / sqrt(mean(x^2) + eps)` times a learned per-channel weight over the last dimension.

    Given a `residual`, the op first adds it to `x` and returns `(normed, x + residual)`.
    """

    weight_init: float = 1.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.variance_epsilon = eps
        self.weight = nn.Parameter(
            torch.full((hidden_size,), self.weight_init, dtype=dtype), requires_grad=False
        )

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.variance_epsilon}, forward={self.forward_method_name}"

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        def sample() -> torch.Tensor:
            x = torch.randn(num_tokens, self.hidden_size, generator=generator)
            return x.to(device=self.weight.device, dtype=dtype)

        return [(sample(),), (sample(), sample())]


class LayerNormBase(CustomOp):
    """`(x - mean(x)) / sqrt(var(x) + eps)` over the last dimension, times a per-channel weight plus a bias
    (GPT-2, GPT-NeoX, OPT, Phi, Starcoder2); parameters named as `nn.LayerNorm` names them, so checkpoints
    load unchanged."""

    def __init__(
        self, hidden_size: int, eps: float = 1e-5, bias: bool = True, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False) if bias else None

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, bias={self.bias is not None}, forward={self.forward_method_name}"

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        x = torch.randn(num_tokens, self.hidden_size, generator=generator) * 3 + 1
        return [(x.to(device=self.weight.device, dtype=dtype),)]


class ActAndMulBase(CustomOp):
    """`act(x[..., :d]) * x[..., d:]` with `d = x.shape[-1] // 2`: the activation of a GLU MLP."""

    def example_inputs(
        self, num_tokens: int, generator: torch.Generator, dtype: torch.dtype
    ) -> list[tuple[torch.Tensor, ...]]:
        return [(torch.randn(num_tokens, _VERIFY_ACT_WIDTH, generator=generator).to(dtype),)]


class GeluAndMulBase(ActAndMulBase):
    """GeGLU: `gelu(gate) * up`, exact (`approximate="none"`) or with the tanh approximation."""

    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
        self.approximate = approximate

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}, forward={self.forward_method_name}"


def act_and_mul_table(
    silu_and_mul: type[ActAndMulBase], gelu_and_mul: type[GeluAndMulBase]
) -> dict[str, Callable[[], CustomOp]]:
    """HF activation name -> act-and-mul factory; gelu_new and gelu_fast are the tanh approximation."""
    gelu_tanh = partial(gelu_and_mul, approximate="tanh")
    return {
        "silu": silu_and_mul,
        "swish": silu_and_mul,
        "gelu": partial(gelu_and_mul, approximate="none"),
        "gelu_pytorch_tanh": gelu_tanh,
        "gelu_new": gelu_tanh,
        "gelu_fast": gelu_tanh,
    }


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output channel (row): `weight ~= q * scale[:, None]`, `scale = max|row| / 127`.

    Computed in float32 whatever the input dtype; an all-zero row gets scale 1 so nothing divides by zero.
    """
    w = weight.float()
    scale = w.abs().amax(dim=1) / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


class _LinearShapeBase(CustomOp):
    """What every linear layer shares: its sizes, the optional bias, the repr and the verification inputs."""

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


class Int8LinearBase(_LinearShapeBase):
    """`x @ (qweight * scale[:, None]).T + bias`: a Linear with int8 weights and one float scale per output.

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


class LinearBase(_LinearShapeBase):
    """`x @ weight.T + bias`, with HF `nn.Linear`'s parameter names, so checkpoints load unchanged."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, dtype: torch.dtype | None = None
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), requires_grad=False)

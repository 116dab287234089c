"""Default RMSNorms: Strata's fused CPU kernel (`csrc/rms_norm.cpp`, with the residual add in the same pass)
on CPU, ATen's `rms_norm` where that kernel cannot be built; a Triton kernel on CUDA (ATen where Triton is
not installed); and a plain formula as `forward_native`, whose numbers the kernels reproduce. The default
LayerNorm is ATen's on every device."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from strata.custom_op import CustomOp
from strata.layers import cpu_kernels, load_triton_kernels
from strata.layers.base import LayerNormBase, RMSNormBase

# Weight dtypes `strata_cpu::rms_norm` reads (and x's, which it takes in the same three); others use ATen.
_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _use_cpu_kernel(norm: RMSNormBase) -> bool:
    """Whether forward_cpu runs Strata's kernel: decided once, in `__init__`, like `Linear.use_kernel` (the
    build may take seconds and `torch.compile` must not trace it)."""
    return (
        norm.forward_method_name == "forward_cpu"
        and norm.weight.dtype in _KERNEL_DTYPES
        and cpu_kernels.load("rms_norm")
    )


def _forward_cpu_kernel(
    norm: RMSNormBase, x: torch.Tensor, residual: torch.Tensor | None, weight_offset: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`strata_cpu::rms_norm`, or `fused_add_rms_norm` given a residual. The ops take x in any shape
    [..., hidden] (q/k norms pass [1, tokens, heads, dim]) and are called on it as it comes: a reshape in
    between would hide the residual add from the `fuse_residual_add_into_rms_norm` compiler pass."""
    if residual is None:
        return torch.ops.strata_cpu.rms_norm(x, norm.weight, norm.variance_epsilon, weight_offset)
    out, new_residual = torch.ops.strata_cpu.fused_add_rms_norm(
        x, residual, norm.weight, norm.variance_epsilon, weight_offset
    )
    return out, new_residual


def _forward_cuda(
    norm: RMSNormBase, x: torch.Tensor, residual: torch.Tensor | None, offset_weight: bool
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """The Triton kernel's result, or None when Triton is missing (the caller then uses ATen)."""
    kernels = load_triton_kernels()
    if kernels is None:
        return None
    out, new_residual = kernels.rms_norm(x, norm.weight, norm.variance_epsilon, residual, offset_weight)
    return out if new_residual is None else (out, new_residual)


def _rms_norm_2d(x: torch.Tensor, hidden_size: int, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """ATen's rms_norm over a 2-D view: on q/k norms' [1, tokens, heads, dim] inputs its shape checks would
    ask whether the (compiled, unbacked) token count is 0 or 1, which `torch.compile` cannot answer."""
    return F.rms_norm(x.reshape(-1, hidden_size), (hidden_size,), weight, eps).view(x.shape)


def _add_residual(x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused-residual form normalises `x + residual` and hands that sum on as the next residual."""
    if residual is None:
        return x, None
    x = x + residual
    return x, x


@CustomOp.register("rms_norm")
class RMSNorm(RMSNormBase):
    """Llama's RMSNorm: statistics in float32, the weight applied in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.use_kernel = _use_cpu_kernel(self)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x, residual = _add_residual(x, residual)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * h.to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            return _forward_cpu_kernel(self, x, residual, weight_offset=False)
        x, residual = _add_residual(x, residual)
        out = _rms_norm_2d(x, self.hidden_size, self.weight, self.variance_epsilon)
        return out if residual is None else (out, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        result = _forward_cuda(self, x, residual, offset_weight=False)
        return self.forward_cpu(x, residual) if result is None else result


@CustomOp.register("gemma_rms_norm")
class GemmaRMSNorm(RMSNormBase):
    """Gemma's RMSNorm: scales by `1 + weight` (the checkpoint stores the offset), all in float32."""

    weight_init = 0.0

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__(hidden_size, eps, dtype)
        self.use_kernel = _use_cpu_kernel(self)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        x, residual = _add_residual(x, residual)
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = (h * (1.0 + self.weight.float())).to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cpu(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self.use_kernel:
            return _forward_cpu_kernel(self, x, residual, weight_offset=True)
        x, residual = _add_residual(x, residual)
        weight = 1.0 + self.weight.float()
        out = _rms_norm_2d(x.float(), self.hidden_size, weight, self.variance_epsilon).to(x.dtype)
        return out if residual is None else (out, residual)

    def forward_cuda(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        result = _forward_cuda(self, x, residual, offset_weight=True)
        return self.forward_cpu(x, residual) if result is None else result


@CustomOp.register("layer_norm")
class LayerNorm(LayerNormBase):
    """ATen's `layer_norm`, which every device has: what `nn.LayerNorm` computes."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (self.hidden_size,), self.weight, self.bias, self.eps)

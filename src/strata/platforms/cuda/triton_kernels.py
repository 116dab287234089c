"""Triton kernels of the default layers on CUDA; importing this module needs Triton installed.

Each kernel reads its input once and writes once: the RMSNorm fuses the optional residual add, the float32
sum of squares and the weight (one program per row); act-and-mul fuses the activation and the product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    out_ptr,
    residual_out_ptr,
    weight_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    OFFSET_WEIGHT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64) * n_cols
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Add in the input dtype, as the unfused `x + residual` does, and hand the sum on.
        x = x + tl.load(residual_ptr + row + cols, mask=mask, other=0.0)
        tl.store(residual_out_ptr + row + cols, x, mask=mask)
    h = x.to(tl.float32)
    h = h * tl.rsqrt(tl.sum(h * h, axis=0) / n_cols + eps)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    if OFFSET_WEIGHT:  # noqa: SIM108 (a constexpr if: Triton compiles only the taken branch)
        out = h * (1.0 + w.to(tl.float32))  # Gemma: the whole product in float32
    else:
        out = h.to(x.dtype) * w  # Llama: the weight applied in the input dtype
    tl.store(out_ptr + row + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    offset_weight: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of `x (+ residual)` over the last dimension; returns `(out, x + residual or None)`."""
    n_cols = x.shape[-1]
    rows = x.reshape(-1, n_cols).contiguous()
    out = torch.empty_like(rows)
    residual_rows = residual.reshape(-1, n_cols).contiguous() if residual is not None else rows
    residual_out = torch.empty_like(rows) if residual is not None else out
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(rows.shape[0],)](
        rows,
        residual_rows,
        out,
        residual_out,
        weight,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        OFFSET_WEIGHT=offset_weight,
        BLOCK=block,
        num_warps=min(max(block // 256, 1), 8),
    )
    new_residual = residual_out.view(x.shape) if residual is not None else None
    return out.view(x.shape), new_residual


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, d, ACT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    gate = tl.load(x_ptr + row * 2 * d + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * 2 * d + d + cols, mask=mask, other=0.0).to(tl.float32)
    if ACT == "silu":
        act = gate * tl.sigmoid(gate)
    elif ACT == "gelu":
        act = 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476))
    else:  # gelu_tanh, with tanh(y) = 2 sigmoid(2y) - 1
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        act = gate * tl.sigmoid(2.0 * inner)
    tl.store(out_ptr + row * d + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:
    """`act(x[..., :d]) * x[..., d:]` for activation "silu", "gelu" or "gelu_tanh", in float32 inside."""
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d).contiguous()
    out = torch.empty((rows.shape[0], d), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(d), 1024)
    _act_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](rows, out, d, ACT=activation, BLOCK=block)
    return out.view(*x.shape[:-1], d)

"""Weight-only int8: swap an HF model's Linear layers for resolved int8 layers, and read int8 checkpoints.

Every `nn.Linear` is replaced: attention projections, the merged gate/up and down projections the fusers
made, and the LM head. The input embedding stays in floating point; a head tied to it gets its own int8
copy of it (a quarter of its float32 bytes), because at batch 1 the head is the largest single matmul (21%
of SmolLM-135M's weight bytes; measured 9.6 ms in float32, 2.2 ms in int8 on one core). Weights are
quantized per output channel as they load.

Folders stored quantized (`strata convert gguf --keep-quantized`) hold `<linear>.qweight` (int8,
`[out, in]`) and `<linear>.qscale` (float, `[out, in / group_size]`, one scale per group of
`group_size` inputs, 32 for GGUF Q8_0) in place of `<linear>.weight`. The loader dequantizes one such pair
at a time and requantizes it per output channel, the layout the int8 kernels take. The group of each row
with the largest scale keeps its int8 values exactly; the others are rounded once more, with the error
bound of per-channel quantization (half the row's scale).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from strata.custom_op import RegistrationError
from strata.layers.base import Int8LinearBase
from strata.models.transformers.layers import resolve

logger = logging.getLogger("strata.models.quantization")

QWEIGHT_SUFFIX = ".qweight"
QSCALE_SUFFIX = ".qscale"


class QuantizedTensorError(ValueError):
    """A quantized checkpoint tensor is malformed (dtype, shape) or lacks its partner."""


def quantize_linears(model: nn.Module) -> int:
    """Replace each `nn.Linear` in `model` (parameters on meta) by the resolved `Int8Linear`.

    Must run inside `set_current_layer_config`, like `fuse_layers`; returns how many were replaced.
    """
    int8_linear = resolve("quantization", "Int8Linear")
    replaced = 0
    for path, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        with torch.device("meta"):
            new = int8_linear(
                module.in_features, module.out_features, module.bias is not None, module.weight.dtype
            )
        if not isinstance(new, Int8LinearBase):  # the loader quantizes through Int8LinearBase's interface
            raise RegistrationError(
                f"{type(new).__qualname__}, the override of Int8Linear, must subclass "
                "strata.layers.base.Int8LinearBase"
            )
        model.set_submodule(path, new)
        replaced += 1
    logger.info("int8 weight-only: %d linear layers", replaced)
    return replaced


def dequantize_groups(name: str, qweight: torch.Tensor, qscale: torch.Tensor) -> torch.Tensor:
    """`qweight * qscale` with each scale repeated over its group of inputs, in float32; checks both first."""
    if qweight.dtype != torch.int8 or qweight.dim() != 2:
        raise QuantizedTensorError(
            f"{name}{QWEIGHT_SUFFIX} must be a 2-D int8 tensor, found {qweight.dtype} "
            f"of shape {tuple(qweight.shape)}"
        )
    rows, cols = qweight.shape
    groups = qscale.shape[1] if qscale.dim() == 2 else 0
    if (
        not qscale.is_floating_point()
        or qscale.dim() != 2
        or qscale.shape[0] != rows
        or not groups
        or cols % groups
    ):
        raise QuantizedTensorError(
            f"{name}{QSCALE_SUFFIX} must be a float tensor of shape [{rows}, G] with G dividing {cols}, "
            f"found {qscale.dtype} of shape {tuple(qscale.shape)}"
        )
    if not bool(torch.isfinite(qscale).all()):
        raise QuantizedTensorError(f"{name}{QSCALE_SUFFIX} holds scales that are not finite")
    return (qweight.float().view(rows, groups, cols // groups) * qscale.float()[:, :, None]).view(rows, cols)
